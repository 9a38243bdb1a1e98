"""Prove that a route recipe computes the collective it replaces, and cannot deadlock.

In the manner of MSCCL's checker (msccl-tools), the recipe runs on symbols instead of
numbers: each chunk of each member holds the set of positions whose contribution it
sums, as a bit set so that groups of thousands check quickly (all_reduce and
reduce_scatter start with every chunk holding its own position; all_gather with only a
member's own chunk, the rest undefined). A collective step on a
sub-group runs when every member of the sub-group has reached it, and they must agree
on it exactly (op and chunk lists): otherwise the sub-group would mix up data or hang.
A send runs together with the matching receive at its peer. A sum that would count a
contribution twice, or read an undefined chunk, is an error; so is a state where no
member can move (deadlock). At the end every chunk must hold what the collective
defines: all positions' sums (all_reduce), position ``p``'s chunk ``p`` (reduce_scatter,
ZeRO's shard order), every chunk ``c`` from position ``c`` (all_gather).

Messages name positions as ranks through ``rank_of`` (a concrete group with that
placement), so that a user sees which rank does what wrong.
"""

from __future__ import annotations

from typing import Callable

from planc.graph.ir import Kind
from planc.program.routes import (
    COLLECTIVE_STEPS,
    RECEIVE_STEPS,
    Recipe,
    Step,
    StepOp,
    recipe_key,
)
from planc.lower.tables import routed_nodes
from planc.plan.mesh import INTER, INTRA, sub_group

Contribution = int | None  # a bit per position; None: undefined


def _positions(bits: int) -> list[int]:
    return [p for p in range(bits.bit_length()) if bits >> p & 1]
MAX_PROBLEMS = 6


class _Problem(Exception):
    pass


class _Run:
    def __init__(self, recipe: Recipe, rank_of: Callable[[int], int]):
        self.recipe, self.rank_of = recipe, rank_of
        n, chunks = recipe.size, recipe.chunks
        if recipe.kind == Kind.ALL_GATHER:
            self.state = [[1 << p if c == p else None for c in range(chunks)]
                          for p in range(n)]
        else:
            self.state = [[1 << p] * chunks for p in range(n)]
        self.next = [0] * n

    def who(self, position: int) -> str:
        return f"rank {self.rank_of(position)}"

    def step_text(self, position: int) -> str:
        k = self.next[position]
        steps = self.recipe.positions[position]
        return f"step {k + 1} ({steps[k].text()})" if k < len(steps) else "its end"

    def pending(self, position: int) -> Step | None:
        steps = self.recipe.positions[position]
        k = self.next[position]
        return steps[k] if k < len(steps) else None

    def _check_chunks(self, position: int, step: Step) -> None:
        flat = [c for item in step.chunks
                for c in (item if isinstance(item, tuple) else (item,))]
        bad = [c for c in flat if not 0 <= c < self.recipe.chunks]
        if bad:
            raise _Problem(f"{self.who(position)}, {self.step_text(position)}: chunk {bad[0]} "
                           f"does not exist (the buffer has {self.recipe.chunks})")

    def _sum(self, parts: list[Contribution], where: str) -> int:
        total = 0
        for part in parts:
            if part is None:
                raise _Problem(f"{where} reads a chunk that holds nothing yet")
            twice = total & part
            if twice:
                raise _Problem(f"{where} counts the contribution of "
                               f"{self.who(_positions(twice)[0])} twice")
            total |= part
        return total

    def collective(self, position: int, step: Step) -> bool:
        members = self.recipe.level_members(position, step.level)
        for q in members:
            other = self.pending(q)
            if other is None or other.op not in COLLECTIVE_STEPS or other.level != step.level:
                return False  # q is elsewhere; it may come later (or never: deadlock)
            if other != step:
                raise _Problem(
                    f"the {step.level} sub-group of {', '.join(self.who(m) for m in members)}"
                    f" disagrees: {self.who(position)} is at {self.step_text(position)} but "
                    f"{self.who(q)} at {self.step_text(q)}")
        for q in members:
            self._check_chunks(q, step)
        m = len(members)
        where = f"{step.op} on the {step.level} sub-group of {self.who(members[0])}"
        if step.op is StepOp.ALL_REDUCE:
            for c in step.chunks:
                value = self._sum([self.state[q][c] for q in members], where)
                for q in members:
                    self.state[q][c] = value
        else:
            if len(step.chunks) != m or len({len(x) for x in step.chunks}) != 1:
                raise _Problem(f"{where}: needs {m} equal lists of chunks, one per member, "
                               f"not {[list(x) for x in step.chunks]}")
            if step.op is StepOp.REDUCE_SCATTER:
                values = [[self._sum([self.state[q][c] for q in members], where)
                           for c in mine] for mine in step.chunks]
                for j, q in enumerate(members):
                    for c, value in zip(step.chunks[j], values[j]):
                        self.state[q][c] = value
            else:  # all_gather
                values = [[self.state[members[j]][c] for c in mine]
                          for j, mine in enumerate(step.chunks)]
                for j, mine in enumerate(step.chunks):
                    if any(v is None for v in values[j]):
                        raise _Problem(f"{where}: {self.who(members[j])} contributes a chunk "
                                       f"that holds nothing yet")
                for q in members:
                    for j, mine in enumerate(step.chunks):
                        for c, value in zip(mine, values[j]):
                            self.state[q][c] = value
        for q in members:
            self.next[q] += 1
        return True

    def point_to_point(self, position: int, step: Step) -> bool:
        n = self.recipe.size
        if not 0 <= step.peer < n or step.peer == position:
            raise _Problem(f"{self.who(position)}, {self.step_text(position)}: position "
                           f"{step.peer} is not another member of the group")
        if step.op is not StepOp.SEND:
            return False  # receives move when their sender does
        peer = step.peer
        other = self.pending(peer)
        if other is None or other.op not in RECEIVE_STEPS or other.peer != position:
            return False
        self._check_chunks(position, step)
        self._check_chunks(peer, other)
        if len(other.chunks) != len(step.chunks):
            raise _Problem(f"{self.who(position)} sends {len(step.chunks)} chunks to "
                           f"{self.who(peer)}, which receives {len(other.chunks)}")
        where = f"{self.who(peer)}, {self.step_text(peer)}"
        for source, target in zip(step.chunks, other.chunks):
            value = self.state[position][source]
            if value is None:
                raise _Problem(f"{self.who(position)} sends a chunk that holds nothing yet")
            if other.op is StepOp.RECV_REDUCE:
                value = self._sum([self.state[peer][target], value], where)
            self.state[peer][target] = value
        self.next[position] += 1
        self.next[peer] += 1
        return True

    def run(self) -> None:
        n = self.recipe.size
        while True:
            moved = False
            for p in range(n):
                step = self.pending(p)
                if step is None:
                    continue
                if step.op in COLLECTIVE_STEPS:
                    moved |= self.collective(p, step)
                else:
                    moved |= self.point_to_point(p, step)
            if all(self.pending(p) is None for p in range(n)):
                return
            if not moved:
                stuck = [p for p in range(n) if self.pending(p) is not None]
                shown = "; ".join(f"{self.who(p)} at {self.step_text(p)}"
                                  for p in stuck[:4])
                more = f"; and {len(stuck) - 4} more" if len(stuck) > 4 else ""
                raise _Problem(f"deadlock: no member can move: {shown}{more}")

    def result_problems(self) -> list[str]:
        recipe, n = self.recipe, self.recipe.size
        everyone = (1 << n) - 1
        problems = []

        def holds(p: int, c: int, want: int, what: str) -> None:
            got = self.state[p][c]
            if got != want and len(problems) < MAX_PROBLEMS:
                have = "nothing" if got is None else \
                    ("every member's contribution" if got == everyone else
                     "the contributions of " + ", ".join(self.who(q)
                                                         for q in _positions(got)))
                problems.append(f"{self.who(p)} ends with chunk {c} holding {have}, "
                                f"not {what}")

        if recipe.kind == Kind.ALL_REDUCE:
            for p in range(n):
                for c in range(recipe.chunks):
                    holds(p, c, everyone, "the sum over the group")
        elif recipe.chunks != n:
            problems.append(f"a {recipe.kind} recipe must cut the buffer into one chunk "
                            f"per member ({n}), not {recipe.chunks}")
        elif recipe.kind == Kind.REDUCE_SCATTER:
            for p in range(n):
                holds(p, p, everyone, "the sum over the group (its shard)")
        else:
            for p in range(n):
                for c in range(n):
                    holds(p, c, 1 << c, f"the shard of {self.who(c)}")
        return problems


def check(recipe: Recipe, rank_of: Callable[[int], int] = lambda p: p) -> list[str]:
    """Everything wrong with ``recipe``: empty if it computes its collective."""
    run = _Run(recipe, rank_of)
    try:
        run.run()
    except _Problem as problem:
        return [str(problem)]
    return run.result_problems()


def check_routes(graph, groups, routes) -> list[str]:
    """Every routed transfer has a recipe for each placement of its groups, the sub-groups
    a hierarchical recipe needs exist and hold the members it was proven on, and every
    recipe computes its collective (checked
    once per recipe, on the first group that uses it, whose ranks the messages name)."""
    problems: list[str] = []
    checked: set[str] = set()
    split_checked: set[tuple[str, tuple[int, ...]]] = set()
    cache: dict[tuple[str, int], dict] = {}
    for node, data in routed_nodes(graph):
        axis = str(data["axis"])
        split = data["route"] == "hierarchical"
        if split and not all(groups.rule(f"{axis}/{level}") for level in (INTRA, INTER)):
            problems.append(f"{node}: its hierarchical route needs the intra- and inter-node "
                            f"sub-groups of {axis}, which groups.json does not define")
            split = False
        key = (axis, data["stage"])
        if key not in cache:
            cache[key] = groups.shapes(*key) if groups.rule(axis) else {}
        for counts, members in sorted(cache[key].items()):
            if split and (axis, members) not in split_checked:
                split_checked.add((axis, members))
                problems += _sub_group_problems(node, axis, members, groups)
            recipe_id = recipe_key(str(data["kind"]), data["route"], counts)
            recipe = routes.recipes.get(recipe_id)
            if recipe is None:
                problems.append(f"{node}: routes.json has no recipe {recipe_id} for its "
                                f"{axis} group {list(members)}")
                break
            if recipe_id in checked:
                continue
            checked.add(recipe_id)
            problems += [f"{node}, {data['route']} {data['kind']} on {axis} group "
                         f"{list(members)}: {problem}"
                         for problem in check(recipe, lambda p, m=members: m[p])]
    return problems


def _sub_group_problems(node: str, axis: str, members: tuple[int, ...], groups
                        ) -> list[str]:
    """The sub-groups groups.json gives each member of a group that a hierarchical recipe
    runs on are the ones the recipe was proven on: the members on its node (intra), one
    per node at its place (inter). A rank whose handle held other ranks would reduce with
    the wrong ones or hang."""
    for level in (INTRA, INTER):
        rule = groups.rule(f"{axis}/{level}")
        for rank in members:
            want = sub_group(members, rank, level, groups.devices_per_node)
            have = groups.members(rank, rule)
            if have != want:
                return [f"{node}: groups.json gives rank {rank} the {level}-node sub-group "
                        f"{list(have)} of {axis}, but its hierarchical route runs on "
                        f"{list(want)}, rank {rank}'s {level}-node part of the {axis} group "
                        f"{list(members)}"]
    return []

"""Tree and hierarchical routes as recipes: what each member of a group does, step by step.

A recipe is written by the compiler for one (collective, route, placement) and executed
literally by the runtime (:mod:`planc.runtime.engine.routes`); the verifier proves it computes
the collective it replaces (:mod:`planc.verify.routes`), as MSCCL's checker does
for its instruction DAGs.

The collective's buffer is cut into ``chunks`` equal pieces (padded at the end). A
member is known by its *position* in the group (members in increasing rank order; the
members on one node are consecutive positions); ``counts`` gives the members on each
node the group spans. Its *local index* is its place among the members on its node.

Steps:

- ``reduce_scatter`` / ``all_gather`` on a sub-group (``level``: ``intra``, the group's
  members on this node, ordered by local index; ``inter``, the members with this local
  index on every node, ordered by node), with ``chunks`` a list per sub-group member:
  member ``j`` ends with (reduce_scatter) the sum over the sub-group of the chunks in
  list ``j``, or (all_gather) every member ends with every member's listed chunks;
- ``all_reduce`` on a sub-group, of the chunks listed;
- ``send`` / ``recv`` / ``recv_reduce`` with the member at position ``peer`` over the
  whole group, of the chunks listed (``recv_reduce`` adds what arrives).

Hierarchical all_reduce (Thakur, Rabenseifner and Gropp 2005, NCCL's two-level trees):
reduce_scatter inside the node into ``L`` chunks, all_reduce of chunk ``l`` between
nodes, all_gather inside the node. Hierarchical reduce_scatter keeps ZeRO's shard order
(position ``p`` owns chunk ``p`` of ``n``): inside the node, local index ``l`` collects
chunks ``l, L + l, 2 L + l, ...``; between nodes, node ``k`` keeps chunk ``k L + l``.
all_gather runs the same two steps backwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import accumulate

from planc.program.names import Kind, Route
from planc.plan.mesh import INTER, INTRA
from planc.vocabulary.versions import is_version

ROUTES_FORMAT_VERSION = 1
LEVELS = (INTRA, INTER)  # the sub-groups a route step may run on


class StepOp(StrEnum):
    """What a route step does (the module's docstring); its value is the JSON's ``op``."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    SEND = "send"
    RECV = "recv"
    RECV_REDUCE = "recv_reduce"


COLLECTIVE_STEPS = (StepOp.REDUCE_SCATTER, StepOp.ALL_REDUCE, StepOp.ALL_GATHER)
P2P_STEPS = (StepOp.SEND, StepOp.RECV, StepOp.RECV_REDUCE)
RECEIVE_STEPS = (StepOp.RECV, StepOp.RECV_REDUCE)
CHUNKS_PER_MEMBER_STEPS = (StepOp.REDUCE_SCATTER, StepOp.ALL_GATHER)  # a chunk list each
_STEP_OP_OF_TEXT = {op.value: op for op in StepOp}


@dataclass(frozen=True)
class Step:
    op: StepOp
    chunks: tuple  # reduce_scatter / all_gather: a tuple of chunk tuples per member
    level: str | None = None  # collectives: intra or inter
    peer: int | None = None  # point to point: the other member's position

    def __post_init__(self):
        # Members compare by identity; a step written with its op's text becomes one.
        if self.op.__class__ is not StepOp:
            object.__setattr__(self, "op", StepOp(self.op))

    def to_json(self) -> dict:
        item: dict = {"op": self.op.value}
        if self.level is not None:
            item["level"] = self.level
        if self.peer is not None:
            item["peer"] = self.peer
        item["chunks"] = [list(c) if isinstance(c, tuple) else c for c in self.chunks]
        return item

    @staticmethod
    def from_json(item) -> "Step":
        if not isinstance(item, dict) or set(item) - {"op", "level", "peer", "chunks"}:
            raise ValueError(f"malformed route step {item!r}")
        text, level, peer = item.get("op"), item.get("level"), item.get("peer")
        op = _STEP_OP_OF_TEXT.get(text) if isinstance(text, str) else None
        chunks = item.get("chunks")
        if op in COLLECTIVE_STEPS:
            if level not in LEVELS or peer is not None:
                raise ValueError(f"route step {op} needs a level (intra or inter) and no peer")
        elif op in P2P_STEPS:
            if level is not None or not isinstance(peer, int) or isinstance(peer, bool):
                raise ValueError(f"route step {op} needs a peer position and no level")
        else:
            raise ValueError(f"unknown route step {text!r}")
        if not isinstance(chunks, list) or not chunks:
            raise ValueError(f"route step {op} lists no chunks")
        if op in CHUNKS_PER_MEMBER_STEPS:
            if not all(isinstance(c, list) and c and all(_is_int(x) for x in c)
                       for c in chunks):
                raise ValueError(f"route step {op} needs a list of chunks per member")
            parsed = tuple(tuple(c) for c in chunks)
        else:
            if not all(_is_int(x) for x in chunks):
                raise ValueError(f"route step {op} needs a list of chunk numbers")
            parsed = tuple(chunks)
        return Step(op, parsed, level, peer)

    def text(self) -> str:
        where = f" on {self.level}" if self.level else f" with position {self.peer}"
        chunks = [list(c) if isinstance(c, tuple) else c for c in self.chunks]
        return f"{self.op}{where} of chunks {chunks}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Recipe:
    kind: str  # the collective it computes
    route: str
    counts: tuple[int, ...]  # members on each node the group spans, in node order
    chunks: int
    positions: tuple[tuple[Step, ...], ...]

    @property
    def key(self) -> str:
        return recipe_key(self.kind, self.route, self.counts)

    @property
    def size(self) -> int:
        return sum(self.counts)

    def node_of(self, position: int) -> int:
        return next(k for k, end in enumerate(accumulate(self.counts)) if position < end)

    def offset(self, node: int) -> int:
        return sum(self.counts[:node])

    def local_of(self, position: int) -> int:
        return position - self.offset(self.node_of(position))

    def level_members(self, position: int, level: str) -> tuple[int, ...]:
        """The positions of ``position``'s sub-group at ``level``, in sub-group order."""
        node = self.node_of(position)
        if level == INTRA:
            return tuple(range(self.offset(node), self.offset(node) + self.counts[node]))
        local = self.local_of(position)
        return tuple(self.offset(k) + local for k in range(len(self.counts))
                     if local < self.counts[k])

    def to_json(self) -> dict:
        """Steps are stored once and named by index: most positions share most steps."""
        steps: list[dict] = []
        index: dict[Step, int] = {}
        positions = []
        for program in self.positions:
            row = []
            for step in program:
                if step not in index:
                    index[step] = len(steps)
                    steps.append(step.to_json())
                row.append(index[step])
            positions.append(row)
        return {"kind": self.kind, "route": self.route, "counts": list(self.counts),
                "chunks": self.chunks, "steps": steps, "positions": positions}

    @staticmethod
    def from_json(item) -> "Recipe":
        if not isinstance(item, dict):
            raise ValueError("a route recipe must be an object")
        kind, route = item.get("kind"), item.get("route")
        if kind not in (k.value for k in Kind) or route not in (r.value for r in Route):
            raise ValueError(f"route recipe for unknown collective {kind!r} or route {route!r}")
        counts, chunks = item.get("counts"), item.get("chunks")
        if not isinstance(counts, list) or not counts or \
                not all(_is_int(c) and c > 0 for c in counts):
            raise ValueError("route recipe counts must be positive integers")
        if not _is_int(chunks) or chunks < 1:
            raise ValueError("route recipe chunks must be a positive integer")
        if chunks > sum(counts):  # a recipe cuts its buffer into at most one per member
            raise ValueError(f"route recipe chunks ({chunks}) exceed its members "
                             f"({sum(counts)})")
        steps = [Step.from_json(s) for s in item.get("steps", [])]
        positions = item.get("positions")
        if not isinstance(positions, list) or len(positions) != sum(counts):
            raise ValueError(f"route recipe {route}/{kind} must give one step list per "
                             f"member ({sum(counts)})")
        rows = []
        for row in positions:
            if not isinstance(row, list) or not all(_is_int(i) and 0 <= i < len(steps)
                                                    for i in row):
                raise ValueError("route recipe positions must list step numbers")
            rows.append(tuple(steps[i] for i in row))
        return Recipe(kind, route, tuple(counts), chunks, tuple(rows))


def recipe_key(kind: str, route: str, counts: tuple[int, ...]) -> str:
    """'hierarchical/all_reduce/4+4': how the runtime finds the recipe for its group."""
    return f"{route}/{kind}/{'+'.join(map(str, counts))}"


def hierarchical(kind: str, counts: tuple[int, ...]) -> Recipe:
    local, nodes = counts[0], len(counts)
    if len(set(counts)) != 1 or local < 2 or nodes < 2:
        raise ValueError(f"a hierarchical route needs the same number (at least 2) of "
                         f"members on each of at least 2 nodes, not {list(counts)}")
    n = local * nodes
    rows = []
    for position in range(n):
        node, mine = divmod(position, local)
        if kind == Kind.ALL_REDUCE:
            parts = tuple((j,) for j in range(local))
            rows.append((Step(StepOp.REDUCE_SCATTER, parts, INTRA),
                         Step(StepOp.ALL_REDUCE, (mine,), INTER),
                         Step(StepOp.ALL_GATHER, parts, INTRA)))
            continue
        inside = tuple(tuple(k * local + j for k in range(nodes)) for j in range(local))
        across = tuple((k * local + mine,) for k in range(nodes))
        if kind == Kind.REDUCE_SCATTER:
            rows.append((Step(StepOp.REDUCE_SCATTER, inside, INTRA),
                         Step(StepOp.REDUCE_SCATTER, across, INTER)))
        elif kind == Kind.ALL_GATHER:
            rows.append((Step(StepOp.ALL_GATHER, across, INTER),
                         Step(StepOp.ALL_GATHER, inside, INTRA)))
        else:
            raise ValueError(f"{kind} has no hierarchical route")
    chunks = local if kind == Kind.ALL_REDUCE else n
    return Recipe(str(kind), Route.HIERARCHICAL.value, tuple(counts), chunks, tuple(rows))


def tree(kind: str, counts: tuple[int, ...]) -> Recipe:
    """all_reduce: reduce up, then broadcast down, a binary tree inside each node (rooted
    at its first member) under a binary tree over the nodes' roots."""
    if kind != Kind.ALL_REDUCE:
        raise ValueError(f"{kind} has no tree route")
    offsets = [sum(counts[:k]) for k in range(len(counts))]
    rows = []
    for node, size in enumerate(counts):
        for local in range(size):
            me = offsets[node] + local
            inside = [offsets[node] + c for c in (2 * local + 1, 2 * local + 2) if c < size]
            across = [offsets[c] for c in (2 * node + 1, 2 * node + 2)
                      if c < len(counts)] if local == 0 else []
            if local > 0:
                parent = offsets[node] + (local - 1) // 2
            elif node > 0:
                parent = offsets[(node - 1) // 2]
            else:
                parent = None
            steps = [Step(StepOp.RECV_REDUCE, (0,), peer=p) for p in inside + across]
            if parent is not None:
                steps += [Step(StepOp.SEND, (0,), peer=parent),
                          Step(StepOp.RECV, (0,), peer=parent)]
            steps += [Step(StepOp.SEND, (0,), peer=p) for p in across + inside]
            assert me == len(rows)
            rows.append(tuple(steps))
    return Recipe(str(kind), Route.TREE.value, tuple(counts), 1, tuple(rows))


def build(kind: str, route: str, counts: tuple[int, ...]) -> Recipe:
    if route == Route.HIERARCHICAL:
        return hierarchical(kind, counts)
    if route == Route.TREE:
        return tree(kind, counts)
    raise ValueError(f"route {route} is the backend's own collective and needs no recipe")


@dataclass(frozen=True)
class RouteTable:
    """``programs/routes.json``: every recipe the programs use, by key."""

    recipes: dict[str, Recipe]

    def to_json(self) -> dict:
        return {"format": "planc-routes", "version": ROUTES_FORMAT_VERSION,
                "recipes": {key: r.to_json() for key, r in sorted(self.recipes.items())}}

    @staticmethod
    def from_json(data) -> "RouteTable":
        if not isinstance(data, dict) or data.get("format") != "planc-routes" or \
                not is_version(data.get("version"), ROUTES_FORMAT_VERSION):
            raise ValueError(f"not a version {ROUTES_FORMAT_VERSION} planc route table")
        recipes = data.get("recipes")
        if not isinstance(recipes, dict):
            raise ValueError("the route table has no recipes")
        out = {}
        for key, item in recipes.items():
            recipe = Recipe.from_json(item)
            if recipe.key != key:
                raise ValueError(f"route recipe {key!r} describes {recipe.key}")
            out[key] = recipe
        return RouteTable(out)

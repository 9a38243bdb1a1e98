"""What a pipeline schedule orders: the blocks of one model chunk, each run once per
microbatch.

A stage's program has one block per (kind, chunk): ``F0`` is the forward of chunk 0,
``B1`` the backward of chunk 1. A schedule lists, per stage, which block runs for
which microbatch, in order: an :class:`Action`. The graph writes an action as
``F3`` (the forward of microbatch 3; the chunk is the stage's own) or, with several
chunks per stage, ``B3.c1`` (the backward of microbatch 3 on chunk 1). The kinds follow
the computation types of torch.distributed.pipelining's schedule IR; transfers are not
actions here, because the graph already holds every send and receive and lowering
orders a stage's receives by its peer's schedule.

Both values print to their text and parse back from it exactly, so no code needs to
slice a block's name.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class ActionKind(Enum):
    """One kind of per-microbatch work on a model chunk; the value is its letter."""

    FORWARD = "F"
    BACKWARD = "B"
    # Reserved for zero-bubble schedules (Qi et al., ICLR 2024), which split a backward
    # into the gradient of its input, which the previous chunk waits for, and the
    # gradient of its weights, which nobody waits for and so can fill bubbles.
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    @property
    def letter(self) -> str:
        return self.value

    @property
    def is_forward(self) -> bool:
        return self is ActionKind.FORWARD

    @property
    def flow(self) -> int:
        """The chunk its output goes to, relative to its own: +1 for a forward (the next
        chunk's input), -1 for a backward (the previous chunk's output gradient), 0 when
        it sends nothing (a weight gradient stays on its chunk)."""
        return _FLOW[self]

    @property
    def words(self) -> str:
        """``forward``, ``backward``, ``backward-input``, ``backward-weight``."""
        return self.name.lower().replace("_", "-")


_FLOW = {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1, ActionKind.BACKWARD_INPUT: -1,
         ActionKind.BACKWARD_WEIGHT: 0}
_LETTERS = "".join(kind.letter for kind in ActionKind)
# A canonical number only (no sign, no leading zero), so that text -> value -> text is
# the identity; nine digits at most, as a build is untrusted input.
_NUMBER = r"(0|[1-9][0-9]{0,8})"
_BLOCK_NAME = re.compile(f"([{_LETTERS}]){_NUMBER}")
_ACTION_TEXT = re.compile(f"([{_LETTERS}]){_NUMBER}(?:\\.c{_NUMBER})?")


class Block(NamedTuple):
    """A block of a stage's program: one kind of work on one model chunk."""

    kind: ActionKind
    chunk: int

    @property
    def name(self) -> str:
        """``F0``, ``B1``: the block's name in a program."""
        return f"{self.kind.letter}{self.chunk}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> Block:
        """The block named ``name``; ValueError if it names none."""
        found = _BLOCK_NAME.fullmatch(name) if isinstance(name, str) else None
        if found is None:
            raise ValueError(f"{name!r} is not a block name such as F0 or B1")
        return cls(ActionKind(found.group(1)), int(found.group(2)))

    @classmethod
    def parse_or_none(cls, name: str) -> Block | None:
        """The block named ``name``, or None for a name of no block (views show a build,
        which is untrusted input, whatever its names)."""
        try:
            return cls.parse(name)
        except ValueError:
            return None


class Action(NamedTuple):
    """One entry of a stage's schedule: run ``kind`` on ``chunk`` for ``microbatch``."""

    kind: ActionKind
    microbatch: int
    chunk: int

    @property
    def block(self) -> Block:
        return Block(self.kind, self.chunk)

    def text(self, virtual: int = 1) -> str:
        """``F3``, or ``B3.c1`` when each stage has several (``virtual``) chunks."""
        return f"{self.kind.letter}{self.microbatch}" + (f".c{self.chunk}" if virtual > 1
                                                         else "")

    @classmethod
    def parse(cls, text: str, stage: int, virtual: int = 1) -> Action:
        """The action of :meth:`text` on ``stage``; ValueError if ``text`` is not one."""
        found = _ACTION_TEXT.fullmatch(text) if isinstance(text, str) else None
        if found is None or (found.group(3) is None) != (virtual == 1):
            raise ValueError(f"{text!r} is not a schedule entry such as "
                             + ("F3" if virtual == 1 else "B3.c1"))
        chunk = stage if found.group(3) is None else int(found.group(3))
        return cls(ActionKind(found.group(1)), int(found.group(2)), chunk)

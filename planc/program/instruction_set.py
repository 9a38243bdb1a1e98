"""The instruction set of rank programs (planc.program.program's docstring): what an
instruction does (its opcode), when a guarded one runs, and the events that mark a
node's completion. Members are StrEnums whose values are the program JSON's text, so a
program serialises byte for byte as it did when ops were strings; code compares members
by identity, never their text (tests/test_architecture.py checks it).
"""

from __future__ import annotations

from enum import StrEnum

from planc.program.names import Kind


class Opcode(StrEnum):
    """What an instruction does (planc.program.program's docstring lists them); its value
    is the ``op`` of the program's JSON."""

    COMPUTE = "compute"
    SEND = "send"
    RECV = "recv"
    RECORD = "record"
    WAIT = "wait"
    SYNC = "sync"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


COLLECTIVES = (Opcode.ALL_REDUCE, Opcode.ALL_GATHER, Opcode.REDUCE_SCATTER,
               Opcode.ALL_TO_ALL, Opcode.BROADCAST)
# The collectives are the transfer kinds' (planc.program.names.Kind), written out here so
# that the instruction set reads statically; a new kind must be added to both.
assert COLLECTIVES == tuple(Opcode(kind.value) for kind in Kind if kind.is_collective), \
    "Opcode's collectives differ from planc.program.names.Kind's"
EVENT_OPS = (Opcode.RECORD, Opcode.WAIT, Opcode.SYNC)  # no node, no operands
EVENT_NAMING_OPS = (Opcode.RECORD, Opcode.WAIT)  # name an event rather than a node
TRANSFER_OPS = (Opcode.SEND, Opcode.RECV)  # pipeline point to point
OPCODE_OF_TEXT = {op.value: op for op in Opcode}  # a dict lookup: faster than Opcode(text)


class Guard(StrEnum):
    """Which microbatch's instance of a block a guarded instruction runs in (only)."""

    FIRST = "first"
    LAST = "last"


GUARD_OF_TEXT = {guard.value: guard for guard in Guard}

# A receive's, or a node's, completion: the event ``done:NODE`` (its text is the JSON's).
_DONE = "done:"


def done_event(node: str) -> str:
    """The event recorded once ``node``'s instruction has finished."""
    return _DONE + node


def saved_for_weights(node: str) -> str:
    """The buffer of what ``node`` kept for a later step, apart from its value: a
    forward's for its backward (or recomputation), which so frees the value once its
    readers ran (the logits, a vocabulary wide, once the loss read them); a split
    backward's input half's for its weight-gradient step (what it saved, and its
    output's gradient: Qi et al. 2024), so that the W step frees it without waiting for a
    transfer of the input gradient."""
    return node + ":saved"


def node_of_done(event: str) -> str | None:
    """The node whose completion ``event`` marks (None: another kind of event)."""
    return event[len(_DONE):] if event.startswith(_DONE) else None

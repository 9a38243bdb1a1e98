"""An evaluation batch's blocks, made from training's forward blocks
(:meth:`planc.program.program.Program.for_evaluation`): a forward step keeps nothing for
a backward that never comes, and what training frees in the blocks an evaluation drops is
freed by its last reader in the blocks it keeps."""

from __future__ import annotations

import dataclasses

from planc.program.instruction_set import saved_for_weights
from planc.program.operands import StepKind


def evaluation_step(instruction):
    """An instruction as an evaluation batch runs it: a forward step keeps nothing for a
    backward that never comes (no autograd graph, no ``NODE:saved``), so each
    microbatch's activations are freed as training's last readers free them."""
    operands = instruction.operands
    if operands is None or operands.step is not StepKind.FORWARD:
        return instruction
    kept = saved_for_weights(instruction.node)
    return dataclasses.replace(
        instruction, writes=tuple(w for w in instruction.writes if w != kept),
        operands=dataclasses.replace(operands, keeps_graph=False))


def evaluation_frees(kept: dict[str, tuple], every: dict[str, tuple]) -> dict[str, tuple]:
    """``kept`` (an evaluation's forward blocks) with each buffer that training frees in
    a block the evaluation drops (a ZeRO-3 gather kept for its backward: the head's, the
    last block's) freed by its last reader in the one kept block that reads it, so that
    an evaluation batch does not hold one per microbatch until its end."""
    freed = {b for name, block in every.items() if name not in kept
             for i in block for b in i.frees}
    freed -= {b for block in kept.values() for i in block for b in i.frees}
    readers: dict[str, list[tuple[str, int]]] = {}
    for name, block in kept.items():
        for k, i in enumerate(block):
            for buffer in set(i.reads) & freed:
                readers.setdefault(buffer, []).append((name, k))
    last: dict[tuple[str, int], list[str]] = {}
    for buffer, where in readers.items():
        if len({name for name, _ in where}) == 1:
            last.setdefault(max(where), []).append(buffer)
    return {name: tuple(dataclasses.replace(i, frees=i.frees + tuple(sorted(last[(name, k)])))
                        if (name, k) in last else i for k, i in enumerate(block))
            for name, block in kept.items()}

"""The values a checkpoint holds, refused when no training could have written them.

A weight or an optimizer state that is infinite or NaN, or a second moment (AdamW's
``exp_avg_sq``, a running mean of squares) below zero, would be trained on to a loss of
NaN; the manifest's sha256 does not help, since whoever changed a value can recompute
it. :func:`refuse_bad_values` says which tensor holds what at which index; ``planc run``
calls :func:`check_values` on the whole checkpoint before any rank starts, and every
rank calls :func:`refuse_bad_values` on each block it reads (planc.runtime.checkpoint.load),
so a run started by torchrun, without planc's launcher, is protected too.
:func:`rng_state` refuses an RNG state torch's CPU generator would not take.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from planc.checkpoint.files import checked_path
from planc.checkpoint.manifest import RNG_TENSOR, CheckpointError, reason, state_name
from planc.runtime.launcher.torch_threads import one_torch_thread

SECOND_MOMENTS = ("exp_avg_sq",)  # optimizer states that are never negative
BLOCK_BYTES = 64 << 20  # read at a time: a tensor of a large model can be gigabytes


def refuse_bad_values(where: str, name: str, values: torch.Tensor,
                      origin: tuple[int, ...] = (), non_negative: bool = False) -> None:
    """CheckpointError if ``values`` (the block of tensor ``name`` that starts at index
    ``origin`` of the whole tensor) holds an infinity or a NaN, or, with
    ``non_negative``, a number below zero: ``{where}: NAME holds inf at index (3, 17)``."""
    finite = torch.isfinite(values)
    if bool(finite.all()) and not (non_negative and bool((values < 0).any())):
        return
    bad = ~finite | (values < 0) if non_negative else ~finite
    position = bad.nonzero()[0].tolist()
    value = float(values[tuple(position)])
    index = [start + at for start, at in zip(origin or [0] * len(position), position)]
    if math.isfinite(value):
        shown, why = f"{value:g}", "; a second moment (a mean of squares) is never negative"
    else:
        shown, why = str(value), ""  # inf, -inf or nan
    raise CheckpointError(f"{where}: {name} holds {shown} at index "
                          f"({', '.join(map(str, index))}){why}")


def rng_state(where: str, file: str, state: torch.Tensor) -> torch.Tensor:
    """``state`` (``file``'s RNG state) if torch's CPU generator takes it, tried on a
    generator of its own; else CheckpointError."""
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise CheckpointError(f"{where}: {file} holds {RNG_TENSOR} as {state.dtype} "
                              f"{list(state.shape)}, not the bytes of torch's CPU generator")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{where}: {file} holds a {RNG_TENSOR} state that torch's CPU "
                              f"generator does not take ({reason(exc)})") from None
    return state


def check_values(directory: Path, manifest: dict) -> None:
    """Every parameter, buffer and optimizer state of a checkpoint (found and checked by
    :func:`planc.checkpoint.format.find`) finite, every second moment >= 0, and its RNG state one
    torch takes; CheckpointError naming the first tensor and index that is not."""
    where = f"checkpoint {directory}"
    by_file: dict[str, list[tuple[str, bool]]] = {}
    for param, info in manifest["parameters"].items():
        by_file.setdefault(info["file"], []).append((param, False))
        for key in manifest["optimizer"]["state"]:
            by_file.setdefault(info["optimizer_file"], []).append(
                (state_name(param, key), key in SECOND_MOMENTS))
    for buffer, info in manifest.get("buffers", {}).items():  # a mixture's biases
        by_file.setdefault(info["file"], []).append((buffer, False))
    rng = manifest["rng"]["file"]
    with one_torch_thread():  # in planc run's launcher, which forks the ranks after
        _check_files(directory, where, by_file, rng)


def _check_files(directory: Path, where: str, by_file: dict, rng: str) -> None:
    from safetensors import SafetensorError, safe_open

    for file in sorted(set(by_file) | {rng}):
        try:
            with safe_open(checked_path(directory, file), framework="pt") as handle:
                for name, non_negative in by_file.get(file, ()):
                    _check_tensor(where, name, handle, non_negative)
                if file == rng:
                    rng_state(where, file, handle.get_tensor(RNG_TENSOR))
        except (OSError, SafetensorError) as exc:  # changed since it was checked
            raise CheckpointError(f"{directory / file} cannot be read ({reason(exc)})") \
                from None


def _check_tensor(where: str, name: str, handle, non_negative: bool) -> None:
    """A whole tensor of an open safetensors file, checked a block of rows at a time."""
    saved = handle.get_slice(name)
    shape = saved.get_shape()
    if not shape:  # a scalar cannot be sliced
        refuse_bad_values(where, name, handle.get_tensor(name), (), non_negative)
        return
    rows = max(1, BLOCK_BYTES // max(1, 4 * math.prod(shape[1:])))
    for first in range(0, shape[0], rows):
        refuse_bad_values(where, name, saved[first:first + rows],
                          (first,) + (0,) * (len(shape) - 1), non_negative)

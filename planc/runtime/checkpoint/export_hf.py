"""Writing a planc checkpoint as a transformers checkpoint (the tensor half of
:mod:`planc.hf.export`, which holds the names, the layouts and the config)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from planc.checkpoint.format import CheckpointError, dump_json, find, reason, write_durably
from planc.checkpoint.files import checked_path
from planc.hf.export import DTYPES, Tensor, check_exportable, hf_config, hf_tensors
from planc.host.output_kinds import HUGGING_FACE
from planc.runtime.checkpoint.values import check_values


def export_hf(checkpoint: str, output: str, passed_over=lambda why: None
              ) -> tuple[Path, int, str]:
    """Write the newest complete checkpoint in (or at) ``checkpoint`` to ``output``;
    returns the step directory read, the number of tensors written and the transformers
    class that loads them. ``passed_over(why)`` hears of each newer step directory that
    was not complete or intact, before anything else is checked."""
    found = find(checkpoint)
    for why in found.skipped:
        passed_over(why)
    check_values(found.directory, found.manifest)
    architecture = check_exportable(found.directory, found.manifest)
    model = found.manifest["model"]
    # the parameters, and the state a transformers class holds too (a mixture's balancing
    # biases, DeepSeek-V3's e_score_correction_bias)
    parameters = {**found.manifest.get("buffers", {}), **found.manifest["parameters"]}
    dtype = getattr(torch, DTYPES[model["dtype"]])
    by_file: dict[str, list[str]] = {}
    for name, info in sorted(parameters.items()):
        by_file.setdefault(info["file"], []).append(name)
    values = {}
    for file, names in by_file.items():  # each file opened once
        try:
            with safe_open(checked_path(found.directory, file), framework="pt") as handle:
                for name in names:
                    values[name] = handle.get_tensor(name)
        except (OSError, SafetensorError) as exc:  # changed since it was checked
            raise CheckpointError(f"{found.directory / file} cannot be read "
                                  f"({reason(exc)})") from None
    tensors = {t.target: hf_tensor(t, values).to(dtype) for t in hf_tensors(model)}
    for name, value in tensors.items():  # fp32's finite values past fp16's largest
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{found.directory}: a value of {name} is beyond "
                                  f"{model['dtype']}'s range (largest "
                                  f"{torch.finfo(dtype).max:g}), as the model's dtype "
                                  f"writes it; nothing was written")
    os.makedirs(output, exist_ok=True)
    write_durably(Path(output) / "model.safetensors",
                  save(tensors, metadata={"format": "pt",  # transformers' loader reads it
                                          "generator": HUGGING_FACE.generator}))
    # marked as planc's, as the weights' metadata is, so that a later export may replace
    # it and no other; under a key of its own (transformers keeps an unknown key as an
    # attribute, but reads "generator" as a generator model's config)
    write_durably(Path(output) / "config.json", dump_json(
        {**hf_config(model), "planc": f"written by {HUGGING_FACE.generator}"}))
    return found.directory, len(tensors), architecture.name


def hf_tensor(tensor: Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """One transformers tensor of the planc tensors ``values`` (by full planc name)."""
    parts = [values[source] for source in tensor.sources]
    value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=tensor.join)
    if tensor.swap is not None:
        value = value.transpose(*tensor.swap)
    return value.contiguous()

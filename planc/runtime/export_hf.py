"""Writing a planc checkpoint as a transformers llama checkpoint (the tensor half of
:mod:`planc.export.hf`, which holds the names and the config)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from planc.checkpoint import CheckpointError, dump_json, find, reason, write_durably
from planc.checkpoint_files import checked_path
from planc.export.hf import DTYPES, hf_config, hf_name
from planc.models import family_of
from planc.plan import Model
from planc.runtime.checkpoint_values import check_values


def export_hf(checkpoint: str, output: str) -> tuple[Path, int]:
    """Write the newest complete checkpoint in (or at) ``checkpoint`` to ``output``;
    returns the step directory read and the number of tensors written."""
    found = find(checkpoint)
    check_values(found.directory, found.manifest)
    model = found.manifest["model"]
    if model["family"] != "llama":
        raise CheckpointError(f"{found.directory} holds a model {model['family']}; "
                              f"--format hf writes llama models (LlamaForCausalLM)")
    parameters = found.manifest["parameters"]
    block = Model(**model)  # every field checked with the manifest
    stored = {name: info["shape"] for name, info in parameters.items()}
    expected = {p.name: list(p.shape) for p in family_of(block).all_parameters(block)}
    if stored != expected:  # hf_name and the transposes need exactly these
        name = next(n for n in sorted(set(stored) | set(expected))
                    if stored.get(n) != expected.get(n))
        raise CheckpointError(f"{found.directory}: its parameters are not its model's "
                              f"({name} is {stored.get(name, 'absent')} in the checkpoint, "
                              f"{expected.get(name, 'absent')} in its llama model)")
    dtype = getattr(torch, DTYPES[model["dtype"]])
    by_file: dict[str, list[str]] = {}
    for name, info in sorted(parameters.items()):
        by_file.setdefault(info["file"], []).append(name)
    tensors = {}
    for file, names in by_file.items():  # each file opened once
        try:
            with safe_open(checked_path(found.directory, file), framework="pt") as handle:
                for name in names:
                    value = handle.get_tensor(name)
                    target, transpose = hf_name(name)
                    tensors[target] = (value.t() if transpose else value).contiguous() \
                        .to(dtype)
        except (OSError, SafetensorError) as exc:  # changed since it was checked
            raise CheckpointError(f"{found.directory / file} cannot be read "
                                  f"({reason(exc)})") from None
    os.makedirs(output, exist_ok=True)
    write_durably(Path(output) / "model.safetensors",
                  save(tensors, metadata={"format": "pt"}))
    write_durably(Path(output) / "config.json", dump_json(hf_config(model)))
    return found.directory, len(tensors)

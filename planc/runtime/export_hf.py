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
from planc.export.hf import DTYPES, check_llama, hf_config, hf_name
from planc.runtime.checkpoint_values import check_values


def export_hf(checkpoint: str, output: str) -> tuple[Path, int]:
    """Write the newest complete checkpoint in (or at) ``checkpoint`` to ``output``;
    returns the step directory read and the number of tensors written."""
    found = find(checkpoint)
    check_values(found.directory, found.manifest)
    check_llama(found.directory, found.manifest)
    model, parameters = found.manifest["model"], found.manifest["parameters"]
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

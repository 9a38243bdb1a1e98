"""Writing a planc checkpoint as a transformers llama checkpoint (the tensor half of
:mod:`planc.export.hf`, which holds the names and the config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from planc.checkpoint import MODEL_INDEX, CheckpointError, dump_json, find, write_durably
from planc.export.hf import DTYPES, hf_config, hf_name


def export_hf(checkpoint: str, output: str) -> tuple[Path, int]:
    """Write the newest complete checkpoint in (or at) ``checkpoint`` to ``output``;
    returns the step directory read and the number of tensors written."""
    found = find(checkpoint)
    model = found.manifest["model"]
    if model.get("family") != "llama":
        raise CheckpointError(f"{found.directory} holds a model {model.get('family')}; "
                              f"--format hf writes llama models (LlamaForCausalLM)")
    try:
        index = json.loads((found.directory / MODEL_INDEX).read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{found.directory / MODEL_INDEX} cannot be read ({exc})") \
            from None
    dtype = getattr(torch, DTYPES[model["dtype"]])
    by_file: dict[str, list[str]] = {}
    for name, file in sorted(weight_map.items()):
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in by_file.items():  # each file opened once
        with safe_open(str(found.directory / file), framework="pt") as handle:
            for name in names:
                value = handle.get_tensor(name)
                target, transpose = hf_name(name)
                tensors[target] = (value.t() if transpose else value).contiguous().to(dtype)
    os.makedirs(output, exist_ok=True)
    write_durably(Path(output) / "model.safetensors",
                  save(tensors, metadata={"format": "pt"}))
    write_durably(Path(output) / "config.json", dump_json(hf_config(model)))
    return found.directory, len(tensors)

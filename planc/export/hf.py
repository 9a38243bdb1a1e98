"""A planc checkpoint of a llama model as a Hugging Face transformers checkpoint.

``LlamaForCausalLM.from_pretrained(DIR)`` loads what this writes: ``config.json`` (the
model block as transformers' LlamaConfig names it) and ``model.safetensors`` with
transformers' parameter names. planc stores a linear weight as (in, out) and applies
``x @ W``; torch.nn.Linear stores (out, in), so every projection is transposed. The
tensors are the checkpoint's consolidated fp32 values, written as the model's dtype.

This module is the mapping and the check of the checkpoint's model (no torch);
:mod:`planc.runtime.export_hf` moves the tensors.
"""

from __future__ import annotations

from pathlib import Path

from planc.checkpoint import CheckpointError
from planc.models import FAMILIES, family_of
from planc.plan import Model

# planc name within a block -> (transformers name within a decoder layer, transposed)
_LAYER = {
    "ln1.weight": ("input_layernorm.weight", False),
    "q.weight": ("self_attn.q_proj.weight", True),
    "k.weight": ("self_attn.k_proj.weight", True),
    "v.weight": ("self_attn.v_proj.weight", True),
    "o.weight": ("self_attn.o_proj.weight", True),
    "ln2.weight": ("post_attention_layernorm.weight", False),
    "gate.weight": ("mlp.gate_proj.weight", True),
    "up.weight": ("mlp.up_proj.weight", True),
    "down.weight": ("mlp.down_proj.weight", True),
}
_GLOBAL = {
    "embedding.weight": ("model.embed_tokens.weight", False),
    "final_ln.weight": ("model.norm.weight", False),
    "head.weight": ("lm_head.weight", True),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def hf_name(name: str) -> tuple[str, bool]:
    """(transformers name, whether to transpose) of a llama parameter's planc name."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, layer, local = name.split(".", 2)
    target, transpose = _LAYER[local]
    return f"model.layers.{layer}.{target}", transpose


def hf_config(model: dict) -> dict:
    """transformers' LlamaConfig for a planc ``model llama`` block."""
    heads = model["heads"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model["vocab"], "hidden_size": model["hidden"],
        "intermediate_size": model["ffn"], "num_hidden_layers": model["layers"],
        "num_attention_heads": heads, "num_key_value_heads": model["kv_heads"] or heads,
        "head_dim": model["hidden"] // heads, "hidden_act": "silu",
        "max_position_embeddings": model["seq"], "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "tie_word_embeddings": model["tie_embeddings"], "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "torch_dtype": DTYPES[model["dtype"]], "dtype": DTYPES[model["dtype"]],
        "use_cache": True, "bos_token_id": None, "eos_token_id": None,
    }


def check_llama(directory: Path, manifest: dict) -> None:
    """CheckpointError unless the checkpoint holds a llama model's parameters, each of
    the shape its model block gives it: what hf_name and the transposes need."""
    model = manifest["model"]
    family = FAMILIES.get(model["family"])
    if family is None or family.hf_architecture is None:
        writable = ", ".join(f"{name} ({f.hf_architecture})" for name, f in FAMILIES.items()
                             if f.hf_architecture)
        raise CheckpointError(f"{directory} holds a model {model['family']}; "
                              f"--format hf writes {writable} models")
    block = Model(**model)  # every field checked with the manifest
    stored = {name: info["shape"] for name, info in manifest["parameters"].items()}
    expected = {p.name: list(p.shape) for p in family_of(block).all_parameters(block)}
    if stored != expected:
        name = next(n for n in sorted(set(stored) | set(expected))
                    if stored.get(n) != expected.get(n))
        raise CheckpointError(f"{directory}: its parameters are not its model's "
                              f"({name} is {stored.get(name, 'absent')} in the checkpoint, "
                              f"{expected.get(name, 'absent')} in its llama model)")

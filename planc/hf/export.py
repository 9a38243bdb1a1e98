"""A planc checkpoint as a Hugging Face transformers checkpoint.

``LlamaForCausalLM.from_pretrained(DIR)`` (a llama model) or
``MixtralForCausalLM.from_pretrained(DIR)`` (a moe model that is a Mixtral: no shared
experts, no dense first blocks) or ``DeepseekV3ForCausalLM.from_pretrained(DIR)`` (a
deepseek model with the sigmoid gate), or with ``qk_norm`` ``Qwen3ForCausalLM`` (llama)
and ``Qwen3MoeForCausalLM`` (moe, as Mixtral's), loads what this writes: ``config.json``
(the model block as transformers' config class names it) and ``model.safetensors`` with
transformers' parameter names. A family names its transformers class
(``Family.hf_architecture``, or Qwen3's with ``qk_norm``: :data:`WITH_QK_NORM`);
:data:`ARCHITECTURES` describes each class: its config keys, the tensors of one decoder
layer and the model keys it needs. planc stores a linear weight as (in, out) and applies
``x @ W``; torch.nn.Linear stores (out, in), so every projection is transposed. Mixtral
keeps a block's experts stacked, as planc does, with gate and up fused into one tensor
(``experts.gate_up_proj``, experts x 2 expert_ffn x hidden) and each expert's matrices
(out, in). The tensors are the checkpoint's consolidated fp32 values, written as the
model's dtype.

This module is the mapping and the check of the checkpoint's model (no torch);
:mod:`planc.runtime.checkpoint.export_hf` moves the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from planc.checkpoint.format import CheckpointError
from planc.models import FAMILIES, family_of
from planc.models.llama import qk_norm
from planc.plan.plan import Model
from planc.vocabulary.model_options import balance_bias_names

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Tensor:
    """One transformers tensor made of planc tensors: ``sources``, concatenated along
    dimension ``join`` when there are several, then dimensions ``swap`` exchanged (None:
    as planc stores it). Within a decoder layer, names are relative to the layer."""

    target: str
    sources: tuple[str, ...]
    swap: tuple[int, int] | None = None
    join: int = 0
    # one tensor per expert (``target`` names it with ``{}``), each a row of dimension 0
    # of its one source, ``swap`` then applying to that row's dimensions
    per_expert: bool = False


@dataclass(frozen=True)
class Requirement:
    """A model key the transformers class has only one value of, and why."""

    key: str
    value: Any
    why: str
    # whether a model must have it to start from such a checkpoint (train { init }): a
    # training choice, as a balance loss, is not the checkpoint's
    for_init: bool = True


@dataclass(frozen=True)
class Architecture:
    name: str  # the class: "LlamaForCausalLM"
    model_type: str  # config.json's model_type
    layer: tuple[Tensor, ...]  # one decoder layer's tensors
    config: Callable[[Model], dict]  # config.json's keys beyond the common ones
    requires: tuple[Requirement, ...] = ()
    # one decoder layer's tensors as save_pretrained writes them, where that differs from
    # ``layer`` (the names the class holds in memory, which the export writes)
    saved_layer: tuple[Tensor, ...] = ()


def _linear(target: str, source: str) -> Tensor:
    return Tensor(target, (source,), swap=(0, 1))


_GLOBAL = (
    Tensor("model.embed_tokens.weight", ("embedding.weight",)),
    Tensor("model.norm.weight", ("final_ln.weight",)),
    _linear("lm_head.weight", "head.weight"),  # absent when tied to the embedding
)
_ATTENTION = (
    Tensor("input_layernorm.weight", ("ln1.weight",)),
    *(_linear(f"self_attn.{x}_proj.weight", f"{x}.weight") for x in "qkvo"),
    Tensor("post_attention_layernorm.weight", ("ln2.weight",)),
)
# a dense block's SwiGLU (Llama's, Qwen3's, DeepSeek-V3's first blocks')
_DENSE_MLP = tuple(_linear(f"mlp.{x}_proj.weight", f"{x}.weight")
                   for x in ("gate", "up", "down"))
# each routed expert's projections, as save_pretrained writes Qwen3's and DeepSeek-V3's
_PER_EXPERT_SAVED = tuple(
    Tensor(f"mlp.experts.{{}}.{x}_proj.weight", (f"experts.{x}.weight",), swap=(0, 1),
           per_expert=True) for x in ("gate", "up", "down"))

LLAMA = Architecture(
    name="LlamaForCausalLM", model_type="llama",
    layer=_ATTENTION + _DENSE_MLP,
    config=lambda m: {"intermediate_size": m.ffn, "attention_bias": False,
                      "mlp_bias": False})

MIXTRAL = Architecture(
    name="MixtralForCausalLM", model_type="mixtral",
    layer=_ATTENTION + (
        _linear("mlp.gate.weight", "router.weight"),  # the router
        # (experts, hidden, 2 expert_ffn) -> (experts, 2 expert_ffn, hidden): gate first
        Tensor("mlp.experts.gate_up_proj", ("experts.gate.weight", "experts.up.weight"),
               swap=(1, 2), join=2),
        Tensor("mlp.experts.down_proj", ("experts.down.weight",), swap=(1, 2)),
    ),
    # Mixtral's load-balancing loss (Switch Transformer's) is not planc's: 0 keeps
    # transformers' loss planc's
    config=lambda m: {"intermediate_size": m.expert_ffn, "num_local_experts": m.experts,
                      "num_experts_per_tok": m.top_k, "router_aux_loss_coef": 0.0,
                      "router_jitter_noise": 0.0, "output_router_logits": False,
                      "sliding_window": None},
    requires=(
        Requirement("shared_experts", 0, "Mixtral has no shared experts"),
        Requirement("first_dense", 0, "every Mixtral block is a mixture of experts"),
        Requirement("norm_topk", True, "Mixtral always renormalises each token's top-k "
                                       "routing weights"),
        Requirement("aux_loss", 0, "transformers' Mixtral has no sequence-wise balance loss",
                    for_init=False),
        # written only when set (unwritten: Mixtral's)
        Requirement("score", "softmax", "Mixtral's router scores are softmax probabilities"),
        Requirement("routed_scale", 1.0, "Mixtral does not scale its routing weights"),
        Requirement("route_groups", None, "Mixtral routes to any of its experts"),
        # a run starting from Mixtral's weights starts its biases at zero, as training does
        Requirement("bias_update", None, "Mixtral's router has no balancing bias",
                    for_init=False),
        Requirement("capacity", None, "Mixtral routes every token to its experts "
                    "(dropless)", for_init=False),
    ),
    # transformers 5 saves Mixtral as the Hub's checkpoints hold it (mistralai/Mixtral-8x7B):
    # the router and each expert's w1 (gate), w3 (up) and w2 (down), each (out, in)
    saved_layer=_ATTENTION + (
        _linear("block_sparse_moe.gate.weight", "router.weight"),
        *(Tensor(f"block_sparse_moe.experts.{{}}.{w}.weight", (f"experts.{x}.weight",),
                 swap=(0, 1), per_expert=True)
          for w, x in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
    ))

# Qwen3's attention: llama's, with an RMSNorm of each head's q and k (model { qk_norm })
_QK_NORM_ATTENTION = _ATTENTION + (Tensor("self_attn.q_norm.weight", ("q_norm.weight",)),
                                   Tensor("self_attn.k_norm.weight", ("k_norm.weight",)))
_NO_SLIDING_WINDOW = {"attention_bias": False, "use_sliding_window": False,
                      "sliding_window": None}

QWEN3 = Architecture(
    name="Qwen3ForCausalLM", model_type="qwen3",
    layer=_QK_NORM_ATTENTION + _DENSE_MLP,
    config=lambda m: {"intermediate_size": m.ffn, **_NO_SLIDING_WINDOW})

# Qwen3's mixture holds its experts as Mixtral's does (save_pretrained writes each
# expert's gate_proj, up_proj and down_proj, as the Hub's Qwen/Qwen3-30B-A3B holds them);
# every block a mixture (decoder_sparse_step 1, no mlp_only_layers), no shared expert.
QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM", model_type="qwen3_moe",
    layer=_QK_NORM_ATTENTION + MIXTRAL.layer[len(_ATTENTION):],
    config=lambda m: {"moe_intermediate_size": m.expert_ffn, "num_experts": m.experts,
                      "num_experts_per_tok": m.top_k, "norm_topk_prob": m.norm_topk,
                      "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "router_aux_loss_coef": 0.0, "output_router_logits": False,
                      **_NO_SLIDING_WINDOW},
    requires=tuple(replace(r, why=r.why.replace("Mixtral", "Qwen3-MoE"))
                   for r in MIXTRAL.requires if r.key != "norm_topk"),
    saved_layer=_QK_NORM_ATTENTION + (_linear("mlp.gate.weight", "router.weight"),)
    + _PER_EXPERT_SAVED)

_LATENT_ATTENTION = (
    Tensor("input_layernorm.weight", ("ln1.weight",)),
    _linear("self_attn.q_a_proj.weight", "q_a.weight"),
    Tensor("self_attn.q_a_layernorm.weight", ("ln_q.weight",)),
    _linear("self_attn.q_b_proj.weight", "q_b.weight"),
    _linear("self_attn.kv_a_proj_with_mqa.weight", "kv_a.weight"),
    Tensor("self_attn.kv_a_layernorm.weight", ("ln_kv.weight",)),
    _linear("self_attn.kv_b_proj.weight", "kv_b.weight"),
    _linear("self_attn.o_proj.weight", "o.weight"),
    Tensor("post_attention_layernorm.weight", ("ln2.weight",)),
)
# A DeepSeek-V3 block's MLP: the dense SwiGLU of the first blocks, or the router (with its
# balancing bias, DeepSeek's e_score_correction_bias, when the model keeps one), the
# routed experts and the shared ones; a block holds one or the other.
_DEEPSEEK_MLP = (
    *_DENSE_MLP,
    _linear("mlp.gate.weight", "router.weight"),
    Tensor("mlp.gate.e_score_correction_bias", ("router.balance_bias",)),
    *(_linear(f"mlp.shared_experts.{x}_proj.weight", f"shared.{x}.weight")
      for x in ("gate", "up", "down")),
)


def _deepseek_v3_config(m: Model) -> dict:
    groups = m.options.get("expert_groups") or 1
    return {"intermediate_size": m.ffn, "moe_intermediate_size": m.expert_ffn,
            "n_routed_experts": m.experts, "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.shared_experts, "first_k_dense_replace": m.first_dense,
            "n_group": groups, "topk_group": m.options.get("route_groups") or groups,
            "norm_topk_prob": m.norm_topk,
            "routed_scaling_factor": float(m.options.get("routed_scale") or 1.0),
            "q_lora_rank": m.q_rank, "kv_lora_rank": m.kv_rank, "qk_nope_head_dim": m.nope_dim,
            "qk_rope_head_dim": m.rope_dim, "v_head_dim": m.v_dim, "rope_interleave": True,
            # DeepseekV3Config's head_dim is the rotated features'
            "head_dim": m.rope_dim, "attention_bias": False}


DEEPSEEK_V3 = Architecture(
    name="DeepseekV3ForCausalLM", model_type="deepseek_v3",
    layer=_LATENT_ATTENTION + _DEEPSEEK_MLP + (
        # (experts, hidden, 2 expert_ffn) -> (experts, 2 expert_ffn, hidden): gate first
        Tensor("mlp.experts.gate_up_proj", ("experts.gate.weight", "experts.up.weight"),
               swap=(1, 2), join=2),
        Tensor("mlp.experts.down_proj", ("experts.down.weight",), swap=(1, 2)),
    ),
    config=_deepseek_v3_config,
    requires=(
        Requirement("score", "sigmoid", "DeepSeek-V3's router scores are sigmoid affinities"),
        Requirement("aux_loss", 0, "transformers' DeepSeek-V3 has no sequence-wise balance "
                    "loss", for_init=False),
        Requirement("capacity", None, "DeepSeek-V3 routes every token to its experts "
                    "(dropless)", for_init=False),
    ),
    # transformers 5 saves DeepSeek-V3 as the Hub's checkpoints hold it: each expert's
    # gate, up and down projections, each (out, in)
    saved_layer=_LATENT_ATTENTION + _DEEPSEEK_MLP + _PER_EXPERT_SAVED)

ARCHITECTURES = {a.name: a for a in (LLAMA, MIXTRAL, DEEPSEEK_V3, QWEN3, QWEN3_MOE)}
# A family's class, and the one its models with model { qk_norm } are written as
WITH_QK_NORM = {"LlamaForCausalLM": "Qwen3ForCausalLM",
                "MixtralForCausalLM": "Qwen3MoeForCausalLM"}


def classes_by_family() -> list[str]:
    """Each family that has a transformers class, with it: "llama (LlamaForCausalLM or,
    with qk_norm, Qwen3ForCausalLM)", for the messages that list them."""
    return [f"{name} ({f.hf_architecture}"
            + (f" or, with qk_norm, {WITH_QK_NORM[f.hf_architecture]}"
               if f.hf_architecture in WITH_QK_NORM else "") + ")"
            for name, f in FAMILIES.items() if f.hf_architecture]


def architecture(model: Model) -> Architecture | None:
    """The transformers class a model is written as, if its family has one: the
    family's, or Qwen3's where the model normalises each head's q and k."""
    family = FAMILIES.get(model.family)
    if family is None or family.hf_architecture is None:
        return None
    name = family.hf_architecture
    if qk_norm(model):
        name = WITH_QK_NORM.get(name, name)
    return ARCHITECTURES[name]


def hf_tensors(block: dict) -> list[Tensor]:
    """Every transformers tensor of a planc model block (as the checkpoint's manifest
    holds it), with full planc and transformers names."""
    return model_tensors(Model(**block))


def model_tensors(model: Model, saved: bool = False) -> list[Tensor]:
    """Every transformers tensor of a planc model, with full planc and transformers
    names (a tied head has none: transformers ties lm_head to the embedding too);
    ``saved``: as save_pretrained writes them (Architecture.saved_layer)."""
    arch = architecture(model)
    planc = {p.name for p in family_of(model).all_parameters(model)} | \
        set(balance_bias_names(model))
    tensors = list(_GLOBAL)
    layer_tensors = arch.saved_layer if saved and arch.saved_layer else arch.layer
    for layer in range(model.layers):
        tensors += [Tensor(f"model.layers.{layer}.{t.target}",
                           tuple(f"layers.{layer}.{s}" for s in t.sources), t.swap, t.join,
                           t.per_expert)
                    for t in layer_tensors]
    return [t for t in tensors if all(s in planc for s in t.sources)]


def hf_name(name: str) -> tuple[str, bool]:
    """(transformers name, whether to transpose) of a llama parameter's planc name."""
    if "." in name and name.split(".", 1)[0] == "layers":
        _, layer, local = name.split(".", 2)
        tensor = next(t for t in LLAMA.layer if t.sources == (local,))
        return f"model.layers.{layer}.{tensor.target}", tensor.swap is not None
    tensor = next(t for t in _GLOBAL if t.sources == (name,))
    return tensor.target, tensor.swap is not None


def hf_config(model: dict) -> dict:
    """transformers' config (LlamaConfig, MixtralConfig, Qwen3Config, ...) of a planc
    model block."""
    m = Model(**model)
    arch = architecture(m)
    heads = m.heads
    return {
        "architectures": [arch.name], "model_type": arch.model_type,
        "vocab_size": m.vocab, "hidden_size": m.hidden, "num_hidden_layers": m.layers,
        "num_attention_heads": heads, "num_key_value_heads": m.kv_heads or heads,
        "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.seq, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": 0.02, "torch_dtype": DTYPES[m.dtype], "dtype": DTYPES[m.dtype],
        "use_cache": True, "bos_token_id": None, "eos_token_id": None,
        **arch.config(m),
    }


def _shown(value: Any) -> str:
    if value is None:  # an optional key left out
        return "unset"
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) \
        else str(value)


def check_exportable(directory: Path, manifest: dict) -> Architecture:
    """The transformers class the checkpoint is written as; CheckpointError unless its
    family has one, its model has the values that class needs, and it holds its model's
    parameters, each of the shape its model block gives it: what hf_tensors needs."""
    model = manifest["model"]
    family = FAMILIES.get(model["family"])
    if family is None or family.hf_architecture is None:
        writable = ", ".join(classes_by_family())
        raise CheckpointError(f"{directory} holds a model {model['family']}; "
                              f"--format hf writes {writable} models")
    block = Model(**model)  # every field checked with the manifest
    arch = architecture(block)
    unmet = [r for r in arch.requires if getattr(block, r.key, r.value) != r.value]
    if unmet:
        needed = [f"{r.key} = {_shown(r.value)}" for r in arch.requires]
        first = unmet[0]
        raise CheckpointError(
            f"{directory} holds a model {block.family} with {first.key} = "
            f"{_shown(getattr(block, first.key, first.value))}, which {arch.name} cannot hold "
            f"({first.why}); --format hf writes {block.family} models with "
            f"{', '.join(needed[:-1])} and {needed[-1]}")
    stored = {name: info["shape"] for name, info in manifest["parameters"].items()}
    expected = {p.name: list(p.shape) for p in family_of(block).all_parameters(block)}
    if stored != expected:
        name = next(n for n in sorted(set(stored) | set(expected))
                    if stored.get(n) != expected.get(n))
        raise CheckpointError(f"{directory}: its parameters are not its model's "
                              f"({name} is {stored.get(name, 'absent')} in the checkpoint, "
                              f"{expected.get(name, 'absent')} in its {block.family} model)")
    return arch

"""Starting from a Hugging Face checkpoint (``train { init = "DIR" }``): the inverse of
:mod:`planc.hf.export`, from the same table of tensors, and the check of a directory
against the plan's model (torch-free: config.json and the safetensors headers only).

Every planc parameter is one part of one transformers tensor: the export concatenates
a tensor's planc sources along ``join`` and then exchanges the dimensions ``swap``, so
a planc parameter is ``hf.narrow(axis, start, size).transpose(*swap)``, ``axis`` being
``join`` as seen after the swap (Mixtral's ``experts.gate_up_proj`` holds
``experts.gate.weight`` in its first ``expert_ffn`` rows and ``experts.up.weight`` in the
next). :func:`init_sources` says so for each parameter; the compiler writes it into the
model table (planc.lower.tabulate_model), and each rank reads through it only the boxes
of its slices (planc.runtime.checkpoint.init_load).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from planc.hf.export import (ARCHITECTURES, WITH_QK_NORM, Architecture, _shown, architecture,
                             classes_by_family, hf_config, model_tensors)
from planc.hf.files import (HFCheckpointError, check_tensors, read_config,
                             stored_tensors)
from planc.program.model_table import InitSource
from planc.models import FAMILIES, family_of
from planc.plan.plan import Model


def _swapped(dim: int, swap: tuple[int, int] | None) -> int:
    if swap is None:
        return dim
    return {swap[0]: swap[1], swap[1]: swap[0]}.get(dim, dim)


def init_sources(model: Model, saved: bool
                 ) -> tuple[dict[str, InitSource], dict[str, tuple[int, ...]]]:
    """(planc parameter -> its InitSource, transformers tensor -> its shape) of a model whose
    family has a transformers class; ``saved``: the tensors as save_pretrained writes
    them (planc.hf.export.Architecture.saved_layer)."""
    shapes = {p.name: tuple(p.shape) for p in family_of(model).all_parameters(model)}
    sources, tensors = {}, {}
    for t in model_tensors(model, saved):
        if not all(s in shapes for s in t.sources):  # a balancing bias (init_buffers)
            tensors[t.target] = (model.experts,)
            continue
        whole = list(shapes[t.sources[0]][1:] if t.per_expert else shapes[t.sources[0]])
        join = t.join if len(t.sources) > 1 else 0  # a part of a concatenation, or all
        if len(t.sources) > 1:
            whole[join] = sum(shapes[s][join] for s in t.sources)
        if t.swap is not None:
            a, b = t.swap
            whole[a], whole[b] = whole[b], whole[a]
        experts = shapes[t.sources[0]][0] if t.per_expert else 0
        for e in range(experts) if experts else (None,):
            tensors[t.target.replace("{}", str(e)) if experts else t.target] = tuple(whole)
        start = 0
        for s in t.sources:
            sources[s] = InitSource(t.target, _swapped(join, t.swap), start, t.swap, experts)
            start += shapes[s][join]
    return sources, tensors


def init_buffers(model: Model, saved: bool) -> dict[str, str]:
    """planc's state that a checkpoint also holds -> its transformers tensor: each
    mixture's balancing bias (``bias_update``), DeepSeek-V3's ``e_score_correction_bias``,
    which routes the checkpoint's tokens and so must start where it was, not at zero."""
    params = {p.name for p in family_of(model).all_parameters(model)}
    return {t.sources[0]: t.target for t in model_tensors(model, saved)
            if not all(s in params for s in t.sources)}


def saved_form(model: Model, names) -> bool:
    """Whether a checkpoint holding tensors ``names`` has them as save_pretrained writes
    them (Architecture.saved_layer) rather than as the class holds them in memory (and as
    ``planc export --format hf`` writes them)."""
    arch = architecture(model)
    if arch is None or not arch.saved_layer:
        return False
    saved_only = {t.target for t in model_tensors(model, saved=True)} - \
        {t.target for t in model_tensors(model)}
    return any(name.replace("{}", "0") in names for name in saved_only)


def _architecture(model: Model) -> Architecture:
    """The transformers class the plan's model starts from; HFCheckpointError where its
    family has none."""
    family = FAMILIES.get(model.family)
    if family is None or family.hf_architecture is None:
        named = classes_by_family()
        readable = ", ".join(named[:-1]) + " and " + named[-1]
        raise HFCheckpointError(f"init starts {readable} models from a Hugging Face "
                                f"checkpoint; model {model.family} has no transformers class")
    return architecture(model)


def _type_problem(model: Model, arch: Architecture, config: dict) -> str | None:
    """config.json's model_type where it is not ``arch``'s, with the key that would make
    the plan's model that type when there is one (Qwen3's q/k norms); None if it is."""
    found = config.get("model_type")
    if found is not None and found != arch.model_type:
        family = FAMILIES[model.family].hf_architecture
        flipped = {ARCHITECTURES[WITH_QK_NORM[family]].model_type: "on",
                   ARCHITECTURES[family].model_type: "off"} if family in WITH_QK_NORM else {}
        hint = f", with qk_norm = {flipped[found]} from a {json.dumps(found)} one" \
            if isinstance(found, str) and found in flipped else ""
        return (f"config.json's model_type is {json.dumps(found)}; model {model.family} "
                f"starts from a {json.dumps(arch.model_type)} checkpoint ({arch.name}){hint}")
    return None


def _requirement_problem(model: Model, arch: Architecture) -> str | None:
    """A model key ``arch`` has only one value of, where the plan's model has another."""
    for r in arch.requires:
        if r.for_init and getattr(model, r.key, r.value) != r.value:  # unwritten: met
            return (f"model {model.family} with {r.key} = {_shown(getattr(model, r.key))} "
                    f"cannot start from a {arch.name} checkpoint ({r.why}); it needs "
                    f"{r.key} = {_shown(r.value)}")
    return None


# config.json's keys compared with the plan's model: (transformers key, planc key or
# None for a value planc has only one of). Missing keys take their config class's
# default (transformers' LlamaConfig and MixtralConfig), where it has one.
_COMPARED = (("model_type", "model"), ("hidden_size", "hidden"),
             ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"),
             ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"),
             ("intermediate_size", None), ("vocab_size", "vocab"),
             ("tie_word_embeddings", "tie_embeddings"), ("rope_theta", "rope_theta"),
             ("rms_norm_eps", "norm_eps"), ("hidden_act", None),
             ("attention_bias", None), ("mlp_bias", None),
             ("num_local_experts", "experts"), ("num_experts_per_tok", "top_k"),
             # Qwen3's (num_experts, which transformers 5 saves as num_local_experts)
             ("num_experts", "experts"), ("decoder_sparse_step", None),
             ("mlp_only_layers", None), ("use_sliding_window", None),
             # DeepSeek-V3's
             ("n_routed_experts", "experts"), ("moe_intermediate_size", "expert_ffn"),
             ("n_shared_experts", "shared_experts"), ("first_k_dense_replace", "first_dense"),
             ("n_group", "expert_groups"), ("topk_group", "route_groups"),
             ("norm_topk_prob", "norm_topk"), ("routed_scaling_factor", "routed_scale"),
             ("q_lora_rank", "q_rank"), ("kv_lora_rank", "kv_rank"),
             ("qk_nope_head_dim", "nope_dim"), ("qk_rope_head_dim", "rope_dim"),
             ("v_head_dim", "v_dim"), ("rope_interleave", None))
# a key of config.json that transformers 5 saves under another name
_SAVED_AS = {"num_experts": "num_local_experts"}
_PLANC_KEY = {("intermediate_size", "llama"): "ffn", ("intermediate_size", "mixtral"):
              "expert_ffn", ("intermediate_size", "deepseek_v3"): "ffn",
              ("intermediate_size", "qwen3"): "ffn",
              ("head_dim", "deepseek_v3"): "rope_dim",
              ("num_key_value_heads", "deepseek_v3"): "heads"}
_DEFAULTS = {"llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                       "tie_word_embeddings": False, "hidden_act": "silu",
                       "attention_bias": False, "mlp_bias": False},
             "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                         "hidden_act": "silu", "num_local_experts": 8,
                         "num_experts_per_tok": 2, "num_key_value_heads": 8},
             # transformers' Qwen3Config's and Qwen3MoeConfig's defaults
             "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "head_dim": 128,
                       "tie_word_embeddings": False, "hidden_act": "silu",
                       "attention_bias": False, "use_sliding_window": False},
             "qwen3_moe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "head_dim": 128,
                           "tie_word_embeddings": False, "hidden_act": "silu",
                           "attention_bias": False, "num_experts": 128,
                           "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                           "norm_topk_prob": False, "decoder_sparse_step": 1,
                           "mlp_only_layers": [], "use_sliding_window": False},
             # transformers' DeepseekV3Config's defaults: DeepSeek-V3's sizes
             "deepseek_v3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                             "tie_word_embeddings": False, "hidden_act": "silu",
                             "attention_bias": False, "intermediate_size": 18432,
                             "moe_intermediate_size": 2048, "n_routed_experts": 256,
                             "num_experts_per_tok": 8, "n_shared_experts": 1,
                             "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                             "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                             "q_lora_rank": 1536, "kv_lora_rank": 512,
                             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                             "v_head_dim": 128, "rope_interleave": True}}


# keys transformers' configs compute when null (LlamaConfig: num_key_value_heads from the
# attention heads, head_dim from hidden / heads)
COMPUTED_IF_NULL = ("num_key_value_heads", "head_dim")


def _rope_theta(config: dict) -> object:
    """rope_theta as config.json holds it: in transformers 5's ``rope_parameters`` or at
    the top, as 4 writes it."""
    rope = config.get("rope_parameters")
    theta = config.get("rope_theta")
    return rope.get("rope_theta", theta) if isinstance(rope, dict) else theta


def _rope_problem(config: dict, family: str) -> str | None:
    """What config.json says of its RoPE that planc does not implement: planc's RoPE is
    plain, so ``rope_parameters`` (transformers 5) and ``rope_scaling`` (4, which 5 still
    reads) must each be absent, null or of rope_type 'default'. A dict of transformers 5
    without a type is its default; 4's scaling always names one (``type`` before 4.45)."""
    for key, untyped in (("rope_parameters", "default"), ("rope_scaling", None)):
        value = config.get(key)
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type", untyped)) \
            if isinstance(value, dict) else None
        if kind == "default":
            continue
        what = f"RoPE is {kind!r}" if isinstance(kind, str) else \
            f"{key} is {json.dumps(value)}"
        return f"config.json's {what}; planc's {family} has plain RoPE (rope_type " \
               f"'default', no scaling)"
    return None


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def config_problem(model: Model, arch: Architecture, config: dict) -> str | None:
    """The first key of ``config`` (a config.json) that disagrees with the plan's model,
    naming the field and both values; None when they agree."""
    expected = hf_config(dataclasses.asdict(model))
    defaults = {"num_key_value_heads": config.get("num_attention_heads"),  # LlamaConfig's
                "head_dim": expected["head_dim"], **_DEFAULTS[arch.model_type]}
    problem = _rope_problem(config, model.family)
    if problem is not None:
        return problem
    window = config.get("sliding_window")
    if window is not None and arch.model_type == "mixtral" and not (
            type(window) is int and window >= model.seq):
        return (f"config.json's sliding_window is {json.dumps(window)}; planc attends to all "
                f"{model.seq} tokens of a sequence (seq = {model.seq})")
    found = {**config, "rope_theta": _rope_theta(config)}
    for key, planc_key in _COMPARED:
        if key not in expected:
            continue
        planc_key = _PLANC_KEY.get((key, arch.model_type), planc_key)
        have = found.get(key, found.get(_SAVED_AS.get(key)))
        default = defaults.get(key)
        # written as null: transformers keeps None, not the default, for a number it does
        # not compute itself (an eps of None fails in the first norm), so null is compared
        written_null = key in config and config[key] is None and \
            key not in COMPUTED_IF_NULL and isinstance(default, (int, float)) and \
            not isinstance(default, bool)
        if have is None and not written_null:
            if default is None:
                return f"config.json has no {key} (the plan's model has " \
                       f"{planc_key} = {_shown(expected[key])})"
            have = default
        want = expected[key]
        if _same(have, want):
            continue
        if planc_key is None:
            return (f"config.json's {key} is {json.dumps(have)}; planc's {model.family} has "
                    f"{json.dumps(want)}")
        if planc_key == "model":
            return _type_problem(model, arch, found)
        return (f"config.json's {key} is {json.dumps(have)}; the plan's model has "
                f"{planc_key} = {_shown(want)}")
    return None


def check_init(directory: str | Path, model: Model) -> str:
    """Check a Hugging Face checkpoint directory against the plan's model: its family has
    a transformers class, config.json describes the same model and the safetensors files
    hold every tensor at its shape in a floating dtype. Returns how its tensors are named
    (``saved`` or ``memory``, see :func:`saved_form`); HFCheckpointError says what
    disagrees."""
    arch = _architecture(model)
    # a readable config.json of another class says so first; a model key the class
    # cannot hold is wrong whatever the directory holds
    try:
        config, unread = read_config(directory), None
    except HFCheckpointError as exc:
        config, unread = None, exc
    problem = _type_problem(model, arch, config) if config is not None else None
    if problem is not None:
        raise HFCheckpointError(f"{directory}: {problem}")
    problem = _requirement_problem(model, arch)
    if problem is not None:  # and what the directory lacks, if it cannot be read either
        raise HFCheckpointError(problem + (f"; and {unread}" if unread is not None else ""))
    if unread is not None:
        raise unread
    problem = config_problem(model, arch, config)
    if problem is not None:
        raise HFCheckpointError(f"{directory}: {problem}")
    saved = saved_form(model, stored_tensors(directory))
    check_tensors(directory, init_sources(model, saved)[1])
    return "saved" if saved else "memory"

"""The deepseek family: DeepSeek-V3's block, multi-head latent attention with the moe
family's mixture of experts (DeepSeek-AI 2024, arXiv 2412.19437, section 2.1.1; MLA
from DeepSeek-V2, arXiv 2405.04434, section 2.1), as Hugging Face transformers'
``DeepseekV3Attention`` computes it.

Multi-head latent attention compresses the queries, and the keys and values together,
through low-rank latents, each normalised by its own RMSNorm:

- ``c_q = rmsnorm_q(x W_qa)`` (``q_rank`` features), ``q = c_q W_qb``: per head
  ``nope_dim`` features without positions and ``rope_dim`` rotated ones;
- ``[c_kv | k_r] = x W_kva``: a ``kv_rank`` latent and ``rope_dim`` features of one key,
  rotated and shared by every head; ``c_kv`` normalised, ``c_kv W_kvb`` gives per head
  ``nope_dim`` key features and ``v_dim`` value features;
- attention per head on ``q = [q_nope | q_rope]`` and ``k = [k_nope | k_r]``, scaled by
  ``1 / sqrt(nope_dim + rope_dim)``, its values ``v_dim`` wide; ``o`` reads
  ``heads x v_dim`` features.

RoPE pairs neighbouring features (DeepSeek's interleaved layout: features 2i and 2i + 1
turn by the i-th frequency) and writes the turned pairs' first and second members as
two halves, as transformers' ``apply_rotary_pos_emb_interleave`` does.

The operator ``qkv`` computes all of it up to the heads' q, k and v, which it hands to
``attention`` side by side; the graph keeps llama's operators. Under context
parallelism the keys and values travel as llama's do (gathered, or around the ring),
each head's k and v side by side. DeepSeek-V3 trained without tensor parallelism
(report, section 3.2); over tp this family splits the heads as Megatron-Core's
multi-latent attention does (the up-projections column-parallel, the latents whole on
every rank, their weights' gradients summed over tp). Everything from ``ln2`` on is the
moe family's.
"""

from __future__ import annotations

from dataclasses import replace

from planc.vocabulary.hints import try_values
from planc.vocabulary.kinds import Integer, Key
from planc.models import llama, moe, moe_memory
from planc.models.family import Finding, Model, OpRule, Parameter, Weight

# The attention's own parameters, in the order the qkv kernel reads them.
MLA_PARAMS = ("q_a.weight", "ln_q.weight", "q_b.weight", "kv_a.weight", "ln_kv.weight",
              "kv_b.weight")
LLAMA_ATTENTION = ("q.weight", "k.weight", "v.weight")

# qkv reads every token; over tp (shard { tp { qkv = column } }) each rank makes its
# own heads from the whole latents, as Megatron-Core's multi-latent attention does: the
# up-projections q_b and kv_b split by heads, the down-projections and the latents'
# norms whole on every rank (their gradients summed over tp).
RULES = {**moe.RULES, "qkv": OpRule("tokenwise", params=MLA_PARAMS, placement="qkv",
                                    output_dim="qkv",
                                    column_weights=(Weight("q_b.weight", "q_rank", "q"),
                                                    Weight("kv_b.weight", "kv_rank", "kv")))}

PRESETS = {
    # DeepSeek-V3 (DeepSeek-AI 2024, section 4.2) and deepseek-ai/DeepSeek-V3's
    # config.json: 61 layers, the first 3 dense (width 18,432), 256 routed experts of
    # width 2,048 (8 active) and 1 shared; 128 heads, latents of 1,536 (queries) and
    # 512 (keys and values), heads of 128 + 64 rotated features for q and k and 128 for
    # v; 4k pre-training context. 671B parameters, 37B active, without its
    # multi-token-prediction module.
    "deepseek-v3": {"layers": 61, "hidden": 7168, "heads": 128, "ffn": 18432,
                    "expert_ffn": 2048, "experts": 256, "top_k": 8, "shared_experts": 1,
                    "first_dense": 3, "vocab": 129280, "seq": 4096, "rope_theta": 10000.0,
                    "q_rank": 1536, "kv_rank": 512, "nope_dim": 128, "rope_dim": 64,
                    "v_dim": 128, "dtype": "bf16"},
}


def qk_dim(m: Model) -> int:
    """Features of one head's query and key: those without positions and the rotated."""
    return m.nope_dim + m.rope_dim


def widths(m: Model) -> dict[str, int]:
    """The moe family's widths, with MLA's: q, k and v of every head side by side
    (``qkv``), and the attention's output, heads x v_dim (``context``)."""
    heads = m.heads
    return {**moe.widths(m), "qkv": heads * (2 * qk_dim(m) + m.v_dim),
            "context": heads * m.v_dim, "kv": heads * (qk_dim(m) + m.v_dim)}


def feature_groups(m: Model) -> dict[str, tuple[int, ...]]:
    """[q | k | v] of every head and the dense SwiGLU's [gate | up], each cut in its
    groups over tp: a rank's share is its heads' q, k and v."""
    return {"qkv": (m.heads * qk_dim(m), m.heads * qk_dim(m), m.heads * m.v_dim),
            "gate_up": (m.ffn, m.ffn)}


def projection_shapes(m: Model, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """(N, K) of each GEMM of ``qkv`` per token on one of ``tp`` ranks that split the
    heads, in order: W_qa, W_qb, W_kva, W_kvb (the down-projections whole on each)."""
    h, heads = m.hidden, m.heads // tp
    return ((m.q_rank, h), (heads * qk_dim(m), m.q_rank), (m.kv_rank + m.rope_dim, h),
            (heads * (m.nope_dim + m.v_dim), m.kv_rank))


def linear_gemms(m: Model, tp: int = 1) -> dict[str, tuple[tuple[int, int], ...]]:
    """The GEMMs of the operators that are several (planc.estimate.kernel_cost)."""
    return {"qkv": projection_shapes(m, tp)}


def forward_flops(op: str, s) -> float:
    m = s.model
    bs = s.batch * s.seq
    if op == "qkv":
        return split_flops(op, s, 1)
    if op == "attention":
        per_head = 2.0 * (qk_dim(m) + m.v_dim)  # q k^T, then the scores times v
        return bs * s.seq_full * m.heads * (per_head + 5.0)
    if op == "proj":
        return 2.0 * bs * m.heads * m.v_dim * m.hidden
    return moe.forward_flops(op, s)


def split_flops(op: str, s, tp: int) -> float | None:
    """``qkv`` on one of ``tp`` ranks that split the heads (planc.estimate.model's
    ``split_flops``): the four projections, the two latents' norms and the rotation of
    q's and the shared key's rotated features (a multiply-add per element), the latents'
    GEMMs and norms and the shared key's rotation whole, the up-projections and q's
    rotation on the rank's heads."""
    if op != "qkv":
        return None
    m = s.model
    gemms = sum(2.0 * n * k for n, k in projection_shapes(m, tp))
    rotated = 3.0 * (m.heads // tp + 1) * m.rope_dim
    return s.batch * s.seq * (gemms + 4.0 * (m.q_rank + m.kv_rank) + rotated)


def attention_parameters(m: Model, layer: int) -> list[Parameter]:
    h, heads = m.hidden, m.heads
    shapes = [("q_a.weight", (h, m.q_rank), ("hidden", "q_rank")),
              ("ln_q.weight", (m.q_rank,), ("q_rank",)),
              ("q_b.weight", (m.q_rank, heads * qk_dim(m)), ("q_rank", "q")),
              ("kv_a.weight", (h, m.kv_rank + m.rope_dim), ("hidden", "kv_latent")),
              ("ln_kv.weight", (m.kv_rank,), ("kv_rank",)),
              ("kv_b.weight", (m.kv_rank, heads * (m.nope_dim + m.v_dim)), ("kv_rank", "kv"))]
    return [Parameter(f"layers.{layer}.{name}", shape, dims, layer)
            for name, shape, dims in shapes]


def layer_parameters(m: Model, layer: int) -> list[Parameter]:
    """The moe family's block with MLA's parameters for llama's q, k and v, and ``o``
    reading heads x v_dim features."""
    out: list[Parameter] = []
    for p in moe.layer_parameters(m, layer):
        name = p.name.split(".", 2)[-1]
        if name == "q.weight":
            out.extend(attention_parameters(m, layer))
        elif name == "o.weight":
            out.append(Parameter(p.name, (m.heads * m.v_dim, m.hidden), p.dims, layer))
        elif name not in LLAMA_ATTENTION:
            out.append(p)
    return out


def attention_flops_per_token(m: Model) -> float:
    """One block's attention, forward, per token (Narayanan et al. 2021's count for
    MLA's projections and heads)."""
    gemms = sum(2 * n * k for n, k in projection_shapes(m))
    return gemms + 2 * m.heads * m.v_dim * m.hidden + 2 * m.seq * m.heads * (qk_dim(m) + m.v_dim)


def model_flops_per_token(m: Model) -> float:
    """The moe family's count with MLA in place of llama's attention."""
    return moe.model_flops_per_token(m, attention=attention_flops_per_token)


def latent_attention_kept(m: Model, recompute: str) -> tuple[int, int, int, int]:
    """Features per token that MLA keeps for its backward (planc.models.llama's
    ``attention_kept``): split over tp with the heads, their q, k and v in the dtype and
    the attention's output (o's input) as a GEMM input; whole on every tp rank, the
    latents before their norms in the dtype and after them as GEMM inputs.
    ``attention_inputs`` keeps the attention's output alone (DeepSeek-V3's recomputation
    of its norms and up-projections)."""
    kept = recompute != "attention_inputs"
    latents = m.q_rank + m.kv_rank + m.rope_dim
    heads = m.heads * (2 * qk_dim(m) + m.v_dim)
    return heads * kept, m.heads * m.v_dim, latents * kept, (m.q_rank + m.kv_rank) * kept


def activation_bytes(m: Model, **sizes) -> float:
    """The moe family's count with MLA's attention in place of llama's; the softmax's
    probabilities unless recomputation drops them, as llama's."""
    return moe_memory.activation_bytes(m, attention=latent_attention_kept, **sizes)


def latent_attention_core_kept(m: Model, recompute: str) -> int:
    """Of :func:`latent_attention_kept`'s features, the attention core's: its q, k and v
    (the latents are the qkv step's, which holds their norms' weights)."""
    return m.heads * (2 * qk_dim(m) + m.v_dim) * (recompute != "attention_inputs")


def input_half_bytes(m: Model, **sizes) -> float:
    """The moe family's (planc.models.moe_memory.input_half_bytes) with MLA's attention."""
    return moe_memory.input_half_bytes(m, attention=latent_attention_kept,
                                core=latent_attention_core_kept, **sizes)


def gathered_kv_width(m: Model, tp: int, bias_after_gather: bool = False) -> int:
    """Features per gathered token that MLA's attention keeps of the keys and values
    all-gathered over cp, on one of ``tp`` ranks: its heads' k (nope_dim + rope_dim
    features) and v (v_dim), the one tensor they travel in
    (planc.runtime.families.deepseek.attention); no copies per query head (each head has
    its own k and v)."""
    return max(m.heads // tp, 1) * (qk_dim(m) + m.v_dim)


def _preset(name: str):
    return llama.preset_default(name, PRESETS)


_LLAMA = llama.preset_keys(PRESETS)  # llama's and the mixture's keys, from these presets
_MIXTURE = moe.mixture_keys(PRESETS)
_OWN = {
    "q_rank": Key(Integer(1), _preset("q_rank"), doc="features of the queries' latent "
                                                     "(q_lora_rank)"),
    "kv_rank": Key(Integer(1), _preset("kv_rank"), doc="features of the keys' and values' "
                                                       "latent (kv_lora_rank)"),
    "nope_dim": Key(Integer(1), _preset("nope_dim"),
                    doc="features of a head's query and key without positions "
                        "(qk_nope_head_dim)"),
    "rope_dim": Key(Integer(2), _preset("rope_dim"),
                    doc="rotated features of a head's query and of the shared key "
                        "(qk_rope_head_dim)"),
    "v_dim": Key(Integer(1), _preset("v_dim"), doc="features of a head's value "
                                                   "(v_head_dim)"),
}
# The moe family's order, MLA's keys in place of grouped-query attention's.
_HEADS = moe.KEY_ORDER.index("kv_heads")
KEY_ORDER = moe.KEY_ORDER[:_HEADS] + tuple(_OWN) + tuple(
    name for name in moe.KEY_ORDER[_HEADS:]
    if name not in ("kv_heads", "head_dim", "qk_norm"))
KEYS = {name: _OWN.get(name) or _MIXTURE.get(name) or _LLAMA[name] for name in KEY_ORDER}


def rope_dim_even(m: Model) -> Finding | None:
    """Rotary embedding turns pairs of features (Su et al. 2021)."""
    if m.rope_dim % 2 == 0:
        return None
    return Finding(f"rope_dim ({m.rope_dim}) is odd; rotary embedding turns pairs of "
                   f"features", ("model.rope_dim",),
                   try_values("rope_dim", [m.rope_dim - 1, m.rope_dim + 1]))


def fp8_blocks_split_over_tp(m: Model, tensor, mesh) -> Finding | None:
    """``fp8`` over tp: a rank's heads hold whole scaling tiles in q_b's and kv_b's
    outputs and in o's input (planc.models.llama's check, on MLA's widths)."""
    heads = m.heads // mesh.tp
    return llama.fp8_tiles_whole(m, tensor, mesh, heads * qk_dim(m),
                                 heads * (m.nope_dim + m.v_dim), heads * m.v_dim)


# The moe family's description, with MLA's attention and keys.
FAMILY = replace(
    moe.FAMILY,
    name="deepseek",
    summary="DeepSeek-V3: multi-head latent attention and the moe family's mixture of "
            "experts",
    rules=RULES,
    widths=widths,
    feature_groups=feature_groups,
    forward_flops=forward_flops,
    layer_parameters=layer_parameters,
    model_flops_per_token=model_flops_per_token,
    activation_bytes=activation_bytes,
    input_half_bytes=input_half_bytes,
    gathered_kv_width=gathered_kv_width,
    keys=KEYS,
    presets=PRESETS,
    model_checks=(rope_dim_even, moe.top_k_within_experts, moe.first_dense_within_layers,
                  moe.groups_of_experts, moe.imbalance_within_experts),
    tensor_parallel_checks=(fp8_blocks_split_over_tp,),
    mesh_checks=(moe.ep_divides_the_stage_and_the_experts,),
    hf_architecture="DeepseekV3ForCausalLM",
    module_kernels={op: kernel for op, kernel in llama.MODULE_KERNELS.items()
                    if op not in ("qkv", "attention")},
    linear_gemms=linear_gemms,
    split_flops=split_flops,
)

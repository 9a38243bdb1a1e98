"""The llama family: the architecture of Hugging Face transformers' ``LlamaForCausalLM``.

Token embedding (no position table); ``layers`` blocks of
``x + o(attn(rope(q(n1)), rope(k(n1)), v(n1)))`` with ``n1 = rmsnorm1(x)`` and
``x + down(silu(gate(n2)) * up(n2))`` with ``n2 = rmsnorm2(x)``; a final RMSNorm and
an untied head (unless ``tie_embeddings``). No biases. Grouped-query attention
(Ainslie et al. 2023) with ``kv_heads`` key/value heads; rotary position embedding
(Su et al. 2021) in the rotate-half convention, applied to q and k where they are made,
so that under context parallelism K travels already rotated at its own positions. With
``qk_norm`` each head's q and k pass an RMSNorm over its features before the rotation
(Qwen3, Yang et al. 2025; ``Qwen3ForCausalLM``): one weight of head_dim shared by the q
heads, one by the k heads.

Over tp (Megatron-LM): q, k, v, gate and up column-parallel, o and down row-parallel.
With fewer key/value heads than tp ranks, each rank keeps a copy of the k and v columns
of its group's head and the copies' gradients are summed over tp (Megatron's
replication of query groups). FLOPs follow Narayanan et al. 2021 extended to GQA and
SwiGLU, as Megatron-LM's ``num_floating_point_operations`` counts them.
"""

from __future__ import annotations

from planc.vocabulary.hints import divisors_below, largest_divisors, try_values
from planc.vocabulary.kinds import Boolean, Choice, Integer, Key, Real
from planc.vocabulary.model_options import fp8_tile, gemm_input_bytes
from planc.models.family import (HEAD_OPS, Family, Finding, Model, OpRule, Parameter, Weight,
                                 PRE_NORM_GATHERED_INPUTS, pre_norm_block,
                                 pre_norm_chains)

LAYER_OPS, LINKS = pre_norm_block("swiglu")
QK_NORMS = ("q_norm.weight", "k_norm.weight")  # model { qk_norm }
EMBEDDING_OPS = ("embedding",)

RULES = {
    "embedding": OpRule("embedding", placement="embedding"),
    "ln1": OpRule("norm", params=("ln1.weight",)),
    # with qk_norm, the heads' norms: whole on every tp rank, each rank's gradient of
    # them from its own heads (planc.graph.tensor_parallel)
    "qkv": OpRule("linear", (Weight("q.weight", "hidden", "q"),
                             Weight("k.weight", "hidden", "kv"),
                             Weight("v.weight", "hidden", "kv")),
                  output_dim="qkv", input_dim="hidden", placement="qkv",
                  params=QK_NORMS),
    "attention": OpRule("attention"),
    # o reads the heads side by side (heads x head_dim features, hidden unless head_dim
    # says otherwise); over tp they split as the heads do, under the name "hidden".
    "proj": OpRule("linear", (Weight("o.weight", "hidden", "hidden"),),
                   output_dim="hidden", input_dim="hidden", placement="proj"),
    "attn_residual": OpRule("residual"),
    "ln2": OpRule("norm", params=("ln2.weight",)),
    "fc1": OpRule("linear", (Weight("gate.weight", "hidden", "ffn"),
                             Weight("up.weight", "hidden", "ffn")),
                  output_dim="gate_up", input_dim="hidden", placement="fc1"),
    "swiglu": OpRule("pointwise", input_dim="gate_up", output_dim="ffn"),
    "fc2": OpRule("linear", (Weight("down.weight", "ffn", "hidden"),),
                  output_dim="hidden", input_dim="ffn", placement="fc2"),
    "mlp_residual": OpRule("residual"),
    "final_ln": OpRule("norm", params=("final_ln.weight",)),
    "head": OpRule("linear", (Weight("head.weight", "hidden", "vocab"),),
                   output_dim="vocab", input_dim="hidden", placement="head"),
    "loss": OpRule("loss"),
}

# What a Llama module computes beside its GEMMs and attention, as torchtitan's Llama 3
# writes it (torchtitan 9dec370, models/norms.py RMSNorm, models/llama/model.py
# apply_rotary_emb, repeat_kv and FeedForward, train.py's loss_fn): priced by
# planc.estimate.kernel_cost.
MODULE_KERNELS = {"ln1": "rmsnorm", "ln2": "rmsnorm", "final_ln": "rmsnorm", "qkv": "rope",
                  "attention": "repeat_kv", "swiglu": "swiglu", "loss": "fp32_cross_entropy"}


OUTPUT_TENSOR = {
    "embedding": "stream", "ln1": "stream", "qkv": "qkv", "attention": "context",
    "proj": "stream", "attn_residual": "stream", "ln2": "stream", "fc1": "gate_up",
    "swiglu": "ffn", "fc2": "stream", "mlp_residual": "stream", "final_ln": "stream",
    "head": "logits", "loss": "tokens",
}

PRESETS = {
    # Dubey et al. 2024 (The Llama 3 Herd of Models), Table 3; vocabulary 128,256.
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
                  "vocab": 128256, "seq": 8192, "rope_theta": 500000.0, "dtype": "bf16"},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672,
                   "vocab": 128256, "seq": 8192, "rope_theta": 500000.0, "dtype": "bf16"},
    "llama3-405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
                    "ffn": 53248, "vocab": 128256, "seq": 8192, "rope_theta": 500000.0,
                    "dtype": "bf16"},
    # Qwen/Qwen3-8B's config.json (Qwen3ForCausalLM): 36 layers of 32 heads 128 wide (8
    # k/v heads) on a 4,096-wide stream, each head's q and k normalised, RMSNorm's epsilon
    # 1e-6, rope theta 1e6, untied; 32k context (Yang et al. 2025). 8.19B parameters.
    "qwen3-8b": {"layers": 36, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                 "qk_norm": True, "ffn": 12288, "vocab": 151936, "seq": 32768,
                 "rope_theta": 1e6, "norm_eps": 1e-6, "dtype": "bf16"},
}


def widths(m: Model) -> dict[str, int]:
    hd = m.head_dim
    return {"stream": m.hidden, "qkv": (m.heads + 2 * m.key_value_heads) * hd,
            "context": m.attention_width, "gate_up": 2 * m.ffn, "ffn": m.ffn,
            "logits": m.vocab, "kv": 2 * m.key_value_heads * hd, "tokens": 1}


def feature_groups(m: Model) -> dict[str, tuple[int, ...]]:
    """How a feature dimension is cut over tp, in heads: q and k/v by heads (k/v
    replicated when there are fewer kv heads than ranks), [q | k | v] taking a rank's
    heads of each, [gate | up] a rank's features of each."""
    kv = m.key_value_heads
    return {"qkv": (m.heads, kv, kv), "q": (m.heads,), "kv": (kv,),
            "gate_up": (m.ffn, m.ffn)}


def forward_flops(op: str, s) -> float:
    m = s.model
    bs = s.batch * s.seq
    h, hd, kv, a = s.hidden, m.head_dim, m.key_value_heads, m.attention_width
    return {
        "embedding": 0.0,
        "ln1": 4.0 * bs * h, "ln2": 4.0 * bs * h, "final_ln": 4.0 * bs * h,
        # the projections, then the rotation of q and k (a multiply-add per element),
        # after their heads' norms with qk_norm (4 per element, as a norm's)
        "qkv": 2.0 * bs * h * (s.heads + 2 * kv) * hd
        + (3.0 + 4.0 * qk_norm(m)) * bs * (s.heads + kv) * hd,
        "attention": 4.0 * bs * s.seq_full * a + 5.0 * bs * s.heads * s.seq_full,
        "proj": 2.0 * bs * a * h,
        "attn_residual": bs * h, "mlp_residual": bs * h,
        "fc1": 2.0 * bs * h * 2 * s.ffn,
        "swiglu": 5.0 * bs * s.ffn,
        "fc2": 2.0 * bs * s.ffn * h,
        "head": 2.0 * bs * h * s.vocab,
        "loss": 5.0 * bs * s.vocab,
    }[op]


def layer_parameters(m: Model, layer: int) -> list[Parameter]:
    h, f, hd, kv = m.hidden, m.ffn, m.head_dim, m.key_value_heads
    prefix = f"layers.{layer}."
    shapes = [
        ("ln1.weight", (h,), ("hidden",)),
        ("q.weight", (h, m.heads * hd), ("hidden", "q")),
        ("k.weight", (h, kv * hd), ("hidden", "kv")),
        ("v.weight", (h, kv * hd), ("hidden", "kv")),
        ("o.weight", (m.attention_width, h), ("hidden", "hidden")),
        *([("q_norm.weight", (hd,), ("head_dim",)), ("k_norm.weight", (hd,), ("head_dim",))]
          if qk_norm(m) else []),
        ("ln2.weight", (h,), ("hidden",)),
        ("gate.weight", (h, f), ("hidden", "ffn")),
        ("up.weight", (h, f), ("hidden", "ffn")),
        ("down.weight", (f, h), ("ffn", "hidden")),
    ]
    return [Parameter(prefix + name, shape, dims, layer) for name, shape, dims in shapes]


def embedding_parameters(m: Model) -> list[Parameter]:
    return [Parameter("embedding.weight", (m.vocab, m.hidden), ("vocab", "hidden"), None)]


def head_parameters(m: Model) -> list[Parameter]:
    params = [Parameter("final_ln.weight", (m.hidden,), ("hidden",), None)]
    if not m.tie_embeddings:
        params.append(Parameter("head.weight", (m.hidden, m.vocab), ("hidden", "vocab"), None))
    return params


def attention_flops_per_token(m: Model) -> float:
    """One block's attention, forward, per token: the q, k, v and o projections and the
    attention over the sequence (Narayanan et al. 2021 extended to GQA)."""
    kv, hd, a = m.key_value_heads, m.head_dim, m.attention_width
    return 2 * m.hidden * (m.heads + 2 * kv) * hd + 2 * a * m.hidden + 4 * m.seq * a


def model_flops_per_token(m: Model) -> float:
    per_layer = attention_flops_per_token(m) + 6 * m.hidden * m.ffn
    return m.layers * per_layer + 2 * m.hidden * m.vocab


def attention_kept(m: Model, recompute: str) -> tuple[int, int, int, int]:
    """Features per token that one block's attention keeps for its backward (its input
    norm's aside): in the dtype, the rotated q, k and v (and, with qk_norm, q and k
    before their norms); as GEMM inputs, o's input; both split over tp, and nothing kept
    whole on every tp rank (the last two: in the dtype, as GEMM inputs).
    ``attention_inputs`` keeps o's input alone."""
    kept = recompute != "attention_inputs"
    heads = m.heads + 2 * m.key_value_heads + qk_norm(m) * (m.heads + m.key_value_heads)
    return heads * m.head_dim * kept, m.attention_width, 0, 0


def attention_core_kept(m: Model, recompute: str) -> int:
    """Of :func:`attention_kept`'s features in the dtype, those the attention core keeps
    (the rotated q, k and v; with qk_norm, q and k before their norms are the qkv step's,
    which holds the norms' weights)."""
    return (m.heads + 2 * m.key_value_heads) * m.head_dim * (recompute != "attention_inputs")


def qk_norm(m: Model) -> bool:
    """model { qk_norm }: whether each head's q and k are normalised (Qwen3)."""
    return bool(m.options.get("qk_norm"))


def activation_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     attention=attention_kept, activation_recomputed: bool = False,
                     norms_recomputed: bool = False) -> float:
    """One block, one microbatch, one device, counted as Korthikanti et al. 2022 count
    GPT's (their Table 2) for llama's tensors: the inputs of the two norms and of the
    q/k/v and gate/up GEMMs (sharded only with sequence parallelism), the rotated
    q, k and v, the softmax probabilities (dropped by selective recomputation), the
    input of o, gate and up, and the input of down (sharded over tp).
    ``attention_inputs`` drops the first norm's output and q, k and v too: they are
    recomputed from the block's input. ``attention(m, recompute)``: what the attention
    keeps (:func:`attention_kept`; the deepseek family's multi-head latent attention's).
    ``activation_recomputed``: down's input is computed again from gate and up, not kept
    (optimize { recompute_activation }); ``norms_recomputed``: the norms' outputs, q/k/v's
    and gate/up's inputs, from the norms' inputs (optimize { recompute_norms })."""
    sb = seq * batch
    h, f = m.hidden, m.ffn
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return sb * h / (tp if sp else 1) * m.dtype_bytes
    kept = recompute != "attention_inputs"  # the first norm's output, qkv's input
    in_dtype, gemm_inputs, whole_in_dtype, whole_gemm_inputs = attention(m, recompute)
    # the norms' inputs, and what the attention keeps whole on every tp rank
    stream = 2 * sb * h / (tp if sp else 1) + sb * whole_in_dtype
    split = sb * (in_dtype + 2 * f) / tp  # the attention's; gate and up
    scores = 0 if recompute != "none" else m.heads * seq_full * sb / tp
    # the GEMMs' inputs: of q/k/v and gate/up (a norm's output), the attention's (o's) and
    # down's
    inputs = (1 + kept) * sb * h / (tp if sp else 1) * (not norms_recomputed) + \
        sb * (gemm_inputs + f * (not activation_recomputed)) / tp + sb * whole_gemm_inputs
    return (stream + split + scores) * m.dtype_bytes + inputs * gemm_input_bytes(m)


def gathered_kv_width(m: Model, tp: int, bias_after_gather: bool = False) -> int:
    """Features per gathered token that the attention keeps of the keys and values
    all-gathered over cp (shard { cp { attention = allgather } }), on one of ``tp``
    ranks: every cp rank's keys and values (the attention step's input) and the copies
    repeated per query head that the masked attention reads where heads share them
    (SDPA's mask path takes no groups: planc.runtime.families.llama.attention).
    Measured: a cp 2 llama of bench/memory_live.py's widths held 42.0 MiB more at its
    peak than one rank with its tokens, this count's (with the mask) 42 MiB."""
    heads, kv = max(m.heads // tp, 1), max(m.key_value_heads // tp, 1)
    return 2 * m.head_dim * (kv + heads * (kv < heads))


def input_half_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     core=attention_core_kept, activation_recomputed: bool = False,
                     norms_recomputed: bool = False) -> float:
    """Of :func:`activation_bytes`, what the steps without parameters keep: the attention
    core's q, k and v (``core(m, recompute)``) and softmax probabilities, and SwiGLU's
    inputs, gate and up; the norms' and the GEMMs' inputs stay for the weight half, and
    under ``full`` the block's input alone is kept, for the recomputation. With
    ``activation_recomputed`` the input half makes down's input again from gate and up
    and keeps it for the weight half: it frees gate and up, less the product it made; with
    ``norms_recomputed`` the norms' input halves make their outputs again for the GEMMs'
    weight halves, and free nothing of theirs (the norms' weight halves keep the inputs):
    less by the two outputs."""
    if recompute == "full":
        return 0.0
    sb = seq * batch
    scores = 0 if recompute != "none" else m.heads * seq_full * sb / tp
    swiglu = m.ffn * (1 if activation_recomputed else 2)
    norms = 2 * sb * m.hidden * gemm_input_bytes(m) * norms_recomputed
    return (sb * (core(m, recompute) + swiglu) / tp + scores) * m.dtype_bytes - norms


def preset_default(name: str, presets=PRESETS):
    """The default of key ``name``: the chosen preset's value, or None (none chosen, the
    preset does not set it, or it is another family's: a model block of an unknown
    family is checked against every family's keys at once)."""
    def value(scope):
        chosen = scope.value("preset")
        return presets.get(chosen, {}).get(name) if chosen else None
    return value


def or_fallback(name: str, fallback, presets=PRESETS):
    """The chosen preset's value of ``name``, else ``fallback`` (a value, or a function
    of the block's scope)."""
    def value(scope):
        given = preset_default(name, presets)(scope)
        if given is not None:
            return given
        return fallback(scope) if callable(fallback) else fallback
    return value


def preset_keys(presets) -> dict[str, Key]:
    """llama's keys, their defaults read from ``presets`` (a family built on llama's, a
    mixture of experts, passes its own)."""
    def given(name: str):
        return preset_default(name, presets)

    def or_else(name: str, fallback):
        return or_fallback(name, fallback, presets)

    return {
        "preset": Key(Choice(tuple(presets)), None, doc="a published model whose sizes are "
                                                        "the defaults"),
        "layers": Key(Integer(1), given("layers"), doc="transformer blocks"),
        "hidden": Key(Integer(1), given("hidden"), doc="model width: features per token"),
        "heads": Key(Integer(1), given("heads"), doc="query heads"),
        # grouped-query attention off: every head its own k and v
        "kv_heads": Key(Integer(1), or_else("kv_heads", lambda scope: scope.value("heads")),
                        doc="key/value heads of grouped-query attention (default: heads)"),
        "head_dim": Key(Integer(1), given("head_dim"), optional=True,
                        doc="features of one attention head (default: hidden / heads)"),
        # written only when set: a plan, build or checkpoint without it has no such norms
        "qk_norm": Key(Boolean(), given("qk_norm"), optional=True,
                       doc="an RMSNorm over each head's q and k features before RoPE "
                           "(Qwen3) [off]"),
        "ffn": Key(Integer(1), given("ffn"), doc="SwiGLU width"),
        "vocab": Key(Integer(2), given("vocab"), doc="vocabulary size"),
        "seq": Key(Integer(1), given("seq"), doc="tokens per sequence"),
        "batch": Key(Integer(1), required=True, doc="sequences per step, over all "
                                                    "data-parallel ranks"),
        "dtype": Key(Choice(("fp32", "bf16", "fp16")), or_else("dtype", "fp32"),
                     doc="parameter and activation type"),
        # written only when set: a plan, build or checkpoint without them multiplies in dtype
        "fp8": Key(Choice(("blockwise",)), None, optional=True,
                   doc="the linear layers' GEMMs in FP8 (E4M3), forward and backward, with "
                       "DeepSeek-V3's fine-grained scales: 1 x fp8_tile tiles of "
                       "activations and gradients, fp8_tile x fp8_tile blocks of weights; "
                       "emulated on CPUs [dtype]"),
        "fp8_tile": Key(Integer(1), None, optional=True,
                        doc="the FP8 scaling tile (DeepSeek-V3's 128) [128]"),
        "fp8_gradients": Key(Choice(("e4m3", "e5m2")), None, optional=True,
                             doc="the format of the output gradients in the backward GEMMs: "
                                 "DeepSeek-V3's E4M3, or E5M2's wider range with a bit "
                                 "less (TransformerEngine's HYBRID format) [e4m3]"),
        "rope_theta": Key(Real(0.0, None, False), or_else("rope_theta", 10000.0),
                          doc="base of the rotary embedding's wavelengths"),
        "norm_eps": Key(Real(0.0, 1.0, False), or_else("norm_eps", 1e-5),
                        doc="epsilon of RMSNorm"),
        "tie_embeddings": Key(Boolean(), False, doc="the head is the transposed embedding"),
    }


KEYS = preset_keys(PRESETS)


def kv_heads_divide_heads(m: Model) -> Finding | None:
    """Grouped-query attention: each key/value head serves heads / kv_heads query heads
    (Ainslie et al. 2023)."""
    if m.heads % m.kv_heads == 0:
        return None
    return Finding(f"kv_heads ({m.kv_heads}) must divide heads ({m.heads}): each key/value "
                   f"head serves a group of query heads", ("model.kv_heads", "model.heads"),
                   try_values("kv_heads", largest_divisors(m.heads, m.kv_heads)))


def head_dim_even(m: Model) -> Finding | None:
    """Rotary embedding turns pairs of features (Su et al. 2021)."""
    if m.head_dim % 2 == 0:
        return None
    if "head_dim" in m.options:
        return Finding(f"head_dim ({m.head_dim}) is odd; rotary embedding turns pairs of "
                       f"features", ("model.head_dim",),
                       try_values("head_dim", [d for d in (m.head_dim - 1, m.head_dim + 1)
                                               if d > 0]))
    return Finding(f"the head dimension hidden / heads = {m.head_dim} is odd; rotary "
                   f"embedding turns pairs of features", ("model.heads",))


def fp8_blocks_split_over_tp(m: Model, tensor, mesh) -> Finding | None:
    """``fp8``: a tp shard of a linear layer holds whole scaling tiles (the columns of
    each of q, k, v and gate, up on a rank; the rows of o and down, where the placement
    splits them), so that every rank quantises in the groups one process would
    (planc.runtime.engine.fp8)."""
    kv_heads = max(m.kv_heads // mesh.tp, 1)
    q = m.heads // mesh.tp * m.head_dim
    return fp8_tiles_whole(m, tensor, mesh, q, kv_heads * m.head_dim, q)


def fp8_tiles_whole(m: Model, tensor, mesh, q: int, kv: int, context: int
                    ) -> Finding | None:
    """The check of ``fp8_blocks_split_over_tp`` on a tp rank's features of q (``q``),
    of k and v (``kv``) and of o's input (``context``), and of the dense MLP's."""
    tile = fp8_tile(m)
    if tile is None or mesh.tp == 1:
        return None
    dense = m.family == "llama" or m.first_dense > 0  # a mixture's experts are never split
    ffn = m.ffn // mesh.tp
    widths = [(what, local) for what, local, split in (
        ("q", q, tensor.qkv == "column"), ("k and v", kv, tensor.qkv == "column"),
        ("o's input", context, tensor.proj == "row"),
        ("gate and up", ffn, dense and tensor.fc1 == "column"),
        ("down's input", ffn, dense and tensor.fc2 == "row")) if split]
    for what, local in widths:
        if local % tile:
            return Finding(f"fp8 scales tiles of {tile} features, but a tp rank holds "
                           f"{local} of the features of {what} (tp = {mesh.tp}): a shard "
                           f"must hold whole tiles to quantise as one process does",
                           ("model.fp8_tile", "mesh.tp"),
                           try_values("fp8_tile", [t for t in (128, 64, 32, 16)
                                                   if local % t == 0][:2]))
    return None


def kv_heads_split_over_tp(m: Model, tensor, mesh) -> Finding | None:
    """Column-parallel q/k/v: each rank takes kv_heads / tp key/value heads, or (fewer
    heads than ranks) shares one with tp / kv_heads ranks, as Megatron-LM replicates
    query groups."""
    kv, tp = m.kv_heads, mesh.tp
    if tensor.qkv != "column" or kv % tp == 0 or tp % kv == 0:
        return None
    return Finding(f"kv_heads ({kv}) and tp ({tp}) must divide one another: each rank takes "
                   f"kv_heads / tp key/value heads, or shares one with tp / kv_heads ranks",
                   ("mesh.tp",), try_values("tp", divisors_below(tp, kv)))


FAMILY = Family(
    name="llama",
    summary="Llama-style: RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases",
    layer_ops=LAYER_OPS,
    layer_links=LINKS,
    embedding_ops=EMBEDDING_OPS,
    head_ops=HEAD_OPS,
    chains=pre_norm_chains(EMBEDDING_OPS, LAYER_OPS),
    rules=RULES,
    output_tensor=OUTPUT_TENSOR,
    placements={"embedding": ("vocab", "hidden", "replicate"),
                "qkv": ("column", "replicate"),
                "proj": ("row", "replicate"),
                "fc1": ("column", "replicate"),
                "fc2": ("row", "replicate"),
                "head": ("vocab", "replicate")},
    global_parameters=("embedding.weight", "head.weight", "final_ln.weight"),
    widths=widths,
    feature_groups=feature_groups,
    forward_flops=forward_flops,
    layer_parameters=layer_parameters,
    embedding_parameters=embedding_parameters,
    head_parameters=head_parameters,
    model_flops_per_token=model_flops_per_token,
    activation_bytes=activation_bytes,
    input_half_bytes=input_half_bytes,
    gathered_inputs_kept=PRE_NORM_GATHERED_INPUTS,
    gathered_kv_width=gathered_kv_width,
    norms_made_again=True,
    keys=KEYS,
    presets=PRESETS,
    model_checks=(kv_heads_divide_heads, head_dim_even),
    tensor_parallel_checks=(kv_heads_split_over_tp, fp8_blocks_split_over_tp),
    hf_architecture="LlamaForCausalLM",
    module_kernels=MODULE_KERNELS,
)

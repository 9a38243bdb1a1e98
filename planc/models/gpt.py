"""The gpt family: GPT-2-style pre-LayerNorm decoder blocks (Radford et al. 2019).

Token embedding plus a learned position embedding; ``layers`` blocks of
``x + proj(attn(qkv(ln1(x))))`` and ``x + fc2(gelu(fc1(ln2(x))))`` with biases on every
linear layer; a final LayerNorm and a head (the transposed embedding when tied).
FLOPs count a multiply-add as two, as Narayanan et al. (SC'21, section 5.1) do; the
causal mask is not subtracted, as in their formula. Backward costs twice the forward.
Activation memory is Korthikanti et al. 2022, Table 2.
"""

from __future__ import annotations

from planc.vocabulary.kinds import Boolean, Choice, Integer, Key
from planc.models.family import (HEAD_OPS, Family, Model, OpRule, Parameter, Weight,
                                 PRE_NORM_GATHERED_INPUTS, pre_norm_block,
                                 pre_norm_chains)

LAYER_OPS, LINKS = pre_norm_block("gelu")
EMBEDDING_OPS = ("embedding", "position")

LINEAR_DIMS = {
    "qkv": ("hidden", "qkv"),
    "proj": ("hidden", "hidden"),  # input features are the attention heads, head-major
    "fc1": ("hidden", "ffn"),
    "fc2": ("ffn", "hidden"),
    "head": ("hidden", "vocab"),
}


def _linear(name: str, bias: bool = True) -> OpRule:
    fan_in, fan_out = LINEAR_DIMS[name]
    return OpRule("linear", (Weight(f"{name}.weight", fan_in, fan_out),),
                  f"{name}.bias" if bias else None, output_dim=fan_out, input_dim=fan_in,
                  placement=name)


RULES = {
    "embedding": OpRule("embedding", placement="embedding"),
    "position": OpRule("position", params=("position.weight",)),
    "ln1": OpRule("norm", params=("ln1.weight", "ln1.bias")),
    "qkv": _linear("qkv"),
    "attention": OpRule("attention"),
    "proj": _linear("proj"),
    "attn_residual": OpRule("residual"),
    "ln2": OpRule("norm", params=("ln2.weight", "ln2.bias")),
    "fc1": _linear("fc1"),
    "gelu": OpRule("pointwise", input_dim="ffn", output_dim="ffn"),
    "fc2": _linear("fc2"),
    "mlp_residual": OpRule("residual"),
    "final_ln": OpRule("norm", params=("final_ln.weight", "final_ln.bias")),
    "head": _linear("head", bias=False),
    "loss": OpRule("loss"),
}


OUTPUT_TENSOR = {
    "embedding": "stream", "position": "stream", "ln1": "stream", "qkv": "qkv",
    "attention": "stream", "proj": "stream", "attn_residual": "stream", "ln2": "stream",
    "fc1": "ffn", "gelu": "ffn", "fc2": "stream", "mlp_residual": "stream",
    "final_ln": "stream", "head": "logits", "loss": "tokens",
}


def widths(m: Model) -> dict[str, int]:
    return {"stream": m.hidden, "qkv": 3 * m.hidden, "ffn": m.ffn, "logits": m.vocab,
            "kv": 2 * m.hidden, "tokens": 1}


def feature_groups(m: Model) -> dict[str, tuple[int, ...]]:
    """``qkv`` features are [q | k | v], each ``heads`` heads: a tp shard takes the same
    heads from all three."""
    return {"qkv": (m.heads, m.heads, m.heads)}


def forward_flops(op: str, s) -> float:
    """FLOPs of one operator for one microbatch on one cp rank (all tp ranks together)."""
    bs = s.batch * s.seq
    h = s.hidden
    return {
        "embedding": 0.0,
        "position": bs * h,
        "ln1": 5.0 * bs * h, "ln2": 5.0 * bs * h, "final_ln": 5.0 * bs * h,
        "qkv": 2.0 * bs * h * 3 * h,
        # Q K^T and softmax(.) V over all keys, plus the softmax itself.
        "attention": 4.0 * bs * s.seq_full * h + 5.0 * bs * s.heads * s.seq_full,
        "proj": 2.0 * bs * h * h,
        "attn_residual": bs * h, "mlp_residual": bs * h,
        "fc1": 2.0 * bs * h * s.ffn,
        "gelu": 8.0 * bs * s.ffn,
        "fc2": 2.0 * bs * s.ffn * h,
        "head": 2.0 * bs * h * s.vocab,
        "loss": 5.0 * bs * s.vocab,
    }[op]


def layer_parameters(m: Model, layer: int) -> list[Parameter]:
    h = m.hidden
    prefix = f"layers.{layer}."
    shapes = [
        ("ln1.weight", (h,), ("hidden",)), ("ln1.bias", (h,), ("hidden",)),
        ("qkv.weight", (h, 3 * h), LINEAR_DIMS["qkv"]), ("qkv.bias", (3 * h,), ("qkv",)),
        ("proj.weight", (h, h), LINEAR_DIMS["proj"]), ("proj.bias", (h,), ("hidden",)),
        ("ln2.weight", (h,), ("hidden",)), ("ln2.bias", (h,), ("hidden",)),
        ("fc1.weight", (h, m.ffn), LINEAR_DIMS["fc1"]), ("fc1.bias", (m.ffn,), ("ffn",)),
        ("fc2.weight", (m.ffn, h), LINEAR_DIMS["fc2"]), ("fc2.bias", (h,), ("hidden",)),
    ]
    return [Parameter(prefix + name, shape, dims, layer) for name, shape, dims in shapes]


def embedding_parameters(m: Model) -> list[Parameter]:
    return [Parameter("embedding.weight", (m.vocab, m.hidden), ("vocab", "hidden"), None),
            Parameter("position.weight", (m.seq, m.hidden), ("seq", "hidden"), None)]


def head_parameters(m: Model) -> list[Parameter]:
    """The final LayerNorm and the head; a tied head shares embedding.weight (transposed)."""
    params = [Parameter("final_ln.weight", (m.hidden,), ("hidden",), None),
              Parameter("final_ln.bias", (m.hidden,), ("hidden",), None)]
    if not m.tie_embeddings:
        params.append(Parameter("head.weight", (m.hidden, m.vocab), LINEAR_DIMS["head"], None))
    return params


def model_flops_per_token(m: Model) -> float:
    """Forward FLOPs per token (Narayanan et al. 2021): the block's GEMMs and attention,
    and the head."""
    per_layer = 2 * (4 * m.hidden * m.hidden + 2 * m.hidden * m.ffn) + 4 * m.seq * m.hidden
    return m.layers * per_layer + 2 * m.hidden * m.vocab


def activation_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     activation_recomputed: bool = False, norms_recomputed: bool = False
                     ) -> float:
    """Korthikanti et al. 2022, Table 2: one block, one microbatch, one device;
    ``activation_recomputed``: the second GEMM's input (GeLU's output, 8sbh / tp) is
    computed again from GeLU's input, not kept (optimize { recompute_activation });
    ``norms_recomputed``: the two LayerNorms' outputs (2sbh each, the QKV GEMM's and the
    MLP's first GEMM's inputs, whole on every tp rank) from their inputs (optimize {
    recompute_norms }, never under sequence parallelism)."""
    s, b, h, a = seq, batch, m.hidden, m.heads
    sp = sequence_parallel and tp > 1
    sbh = s * b * h
    if recompute == "full":
        half = 2 * sbh / (tp if sp else 1)
    elif recompute == "selective":
        half = 34 * sbh / tp if sp else sbh * (10 + 24 / tp)
    elif recompute == "attention_inputs":
        # selective's, less the first LayerNorm's output (2sbh, the QKV GEMM's input) and
        # Q, K and V (6sbh / tp), recomputed from the block's input
        half = (34 * sbh / tp if sp else sbh * (10 + 24 / tp)) - \
            2 * sbh / (tp if sp else 1) - 6 * sbh / tp
    elif sp:
        half = sbh / tp * (34 + 5 * a * seq_full / h)
    else:
        half = sbh * (10 + 24 / tp + 5 * a * seq_full / (h * tp))
    if activation_recomputed and recompute != "full":
        half -= 8 * sbh / tp
    if norms_recomputed:
        half -= 4 * sbh
    return half * m.dtype_bytes / 2


def input_half_bytes(m: Model, *, seq: int, seq_full: int, batch: int, tp: int,
                     sequence_parallel: bool, recompute: str,
                     activation_recomputed: bool = False, norms_recomputed: bool = False
                     ) -> float:
    """Of :func:`activation_bytes`, what the steps without parameters keep, in Korthikanti
    et al.'s Table 2 items: Q and K (4sbh), V (2sbh), the softmax's output, its dropout
    mask and the dropout's output (5as^2b), GeLU's input (8sbh), and the two dropout masks
    after the attention and the MLP (sbh each, whole on every tp rank without sequence
    parallelism); the norms' and the four GEMMs' inputs (18sbh) stay for the weight half.
    ``selective`` drops the softmax's items, ``attention_inputs`` Q, K and V too, and
    ``full`` keeps the block's input alone, for the weight half's recomputation. With
    ``activation_recomputed`` the input half makes the second GEMM's input again from
    GeLU's input and keeps it for the weight half: as large as GeLU's input, which it
    frees, so it frees none of the two. With ``norms_recomputed`` the LayerNorms' input
    halves make their outputs again for the GEMMs' weight halves (4sbh), and free none of
    their inputs, which their weight halves keep."""
    s, b, h, a = seq, batch, m.hidden, m.heads
    sp = sequence_parallel and tp > 1
    sbh = s * b * h
    if recompute == "full":
        return 0.0
    masks = 2 * sbh / tp if sp else 2 * sbh
    qkv = 0 if recompute == "attention_inputs" else 6 * sbh / tp
    scores = 5 * a * seq_full * s * b / tp if recompute == "none" else 0
    gelu = 8 * sbh / tp * (not activation_recomputed)
    norms = 4 * sbh * norms_recomputed
    return (masks + qkv + gelu + scores - norms) * m.dtype_bytes / 2


def four_times_hidden(scope) -> int:
    """GPT-2's MLP width: four times the model width (Radford et al. 2019)."""
    return 4 * scope.integer("hidden", None)


KEYS = {
    "layers": Key(Integer(1), required=True, doc="transformer blocks"),
    "hidden": Key(Integer(1), required=True, doc="model width: features per token"),
    "heads": Key(Integer(1), required=True, doc="attention heads; each has hidden / heads "
                                                "features"),
    "ffn": Key(Integer(1), four_times_hidden, doc="MLP width (default 4 x hidden)"),
    "vocab": Key(Integer(2), required=True, doc="vocabulary size"),
    "seq": Key(Integer(1), required=True, doc="tokens per sequence; also the position "
                                              "table's length"),
    "batch": Key(Integer(1), required=True, doc="sequences per step, over all data-parallel "
                                                "ranks"),
    "dtype": Key(Choice(("fp32", "bf16", "fp16")), "fp32", doc="parameter and activation "
                                                               "type"),
    "tie_embeddings": Key(Boolean(), False, doc="the head is the transposed embedding"),
}


def gathered_kv_width(m: Model, tp: int, bias_after_gather: bool = False) -> int:
    """Features per gathered token that the attention keeps of the keys and values
    all-gathered over cp, on one of ``tp`` ranks: k and v of its heads, and where the qkv
    bias is added after the gather (``bias_after_gather``: a row-parallel qkv's, added
    once its partial sums are reduced: planc.runtime.families.gpt.attention) the biased
    copy SDPA keeps beside the gathered step input. Measured (bench/memory_live.py's gpt
    under cp 2): 36.5 MiB more at the peak than one rank with its tokens, this count's
    (with the mask) 34 MiB."""
    return (2 if bias_after_gather else 1) * 2 * m.hidden // tp


FAMILY = Family(
    name="gpt",
    summary="GPT-2-style: learned positions, LayerNorm, GELU, biases, multi-head attention",
    layer_ops=LAYER_OPS,
    layer_links=LINKS,
    embedding_ops=EMBEDDING_OPS,
    head_ops=HEAD_OPS,
    chains=pre_norm_chains(EMBEDDING_OPS, LAYER_OPS),
    rules=RULES,
    output_tensor=OUTPUT_TENSOR,
    placements={"embedding": ("vocab", "hidden", "replicate"),
                "qkv": ("column", "row", "replicate"),
                "proj": ("column", "row", "replicate"),
                "fc1": ("column", "row", "replicate"),
                "fc2": ("column", "row", "replicate"),
                "head": ("vocab", "replicate")},
    global_parameters=("embedding.weight", "position.weight", "head.weight",
                       "final_ln.weight", "final_ln.bias"),
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
)

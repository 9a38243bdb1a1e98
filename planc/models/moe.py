"""The moe family: llama's attention with a mixture of SwiGLU experts in place of the MLP.

Every block is ``x + o(attn(...))`` as in :mod:`planc.models.llama` (RMSNorm,
grouped-query attention, RoPE). From layer ``first_dense`` on, its MLP is a mixture of
experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeek-V2/V3):

- a router, ``hidden x experts`` without bias, whose logits (in fp32) give softmax
  probabilities per token;
- each token goes to its ``top_k`` most probable experts, ties to the lower index, weighted
  by their probabilities, renormalised over the k when ``norm_topk`` (Mixtral, Qwen3);
- an expert is a SwiGLU of width ``expert_ffn``: ``(silu(x G_e) * (x U_e)) D_e``;
- ``shared_experts`` more SwiGLU experts of width ``expert_ffn`` see every token,
  unweighted (DeepSeek-V2's shared experts), kept as one SwiGLU of width
  ``shared_experts x expert_ffn``, which computes the same sum.

Blocks before ``first_dense`` keep llama's dense SwiGLU of width ``ffn``. Dropless: every
token reaches its k experts whatever the load (Megatron-Core's default; MegaBlocks,
Gale et al. 2023), so the result does not depend on the plan.

The experts of a block are three stacked parameters ``experts.gate.weight`` and
``experts.up.weight`` (experts x hidden x expert_ffn) and ``experts.down.weight``
(experts x expert_ffn x hidden). The mixture runs as one operator, ``moe``, whole on every
tp rank: on every token, or on this rank's share of them (Megatron-Core splits the
tokens over tp before routing), its weights' gradients then summed over tp; with
``aux_loss`` always on the share, the balance loss's per-sequence counts summed over the
tp x cp ranks holding a sequence's tokens. FLOPs count the active experts only (each
token's k and the shared ones), as MoE papers count them.
"""

from __future__ import annotations

from planc.vocabulary.hints import divisors_below, try_values
from planc.vocabulary.kinds import Boolean, Choice, Integer, Key, Real
from planc.models import llama, moe_memory
from planc.vocabulary.model_options import expert_capacity, expert_groups_of
from planc.models.family import (HEAD_OPS, Family, Finding, Model, OpRule, Parameter,
                                 pre_norm_chains)

DENSE_OPS, DENSE_LINKS = llama.LAYER_OPS, llama.LINKS
MOE_OPS = DENSE_OPS[:6] + ("moe", "mlp_residual")
MOE_LINKS = tuple(link for link in DENSE_LINKS if link[1] not in ("fc1", "swiglu", "fc2",
                                                                   "mlp_residual")) + (
    ("ln2", "moe", "x"), ("moe", "mlp_residual", "x"), ("attn_residual", "mlp_residual", "skip"))
EMBEDDING_OPS = llama.EMBEDDING_OPS

EXPERT_WEIGHTS = ("experts.gate.weight", "experts.up.weight", "experts.down.weight")
SHARED_WEIGHTS = ("shared.gate.weight", "shared.up.weight", "shared.down.weight")
MOE_PARAMS = ("router.weight",) + EXPERT_WEIGHTS + SHARED_WEIGHTS

# The load-balancing loss is a statistic of each sequence: its counts are summed over
# the ranks holding a sequence's tokens (tp x cp), and each rank differentiates its own.
RULES = {**llama.RULES, "moe": OpRule("tokenwise", params=MOE_PARAMS,
                                      sequence_statistic_when=("aux_loss", "capacity"),
                                      expert_parallel=True)}
OUTPUT_TENSOR = {**llama.OUTPUT_TENSOR, "moe": "stream"}

PRESETS = {
    # Jiang et al. 2024 (Mixtral of Experts), Table 1; config.json of
    # mistralai/Mixtral-8x7B-v0.1: 32k context, rope theta 1e6, vocabulary 32,000.
    "mixtral-8x7b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                     "expert_ffn": 14336, "experts": 8, "top_k": 2, "vocab": 32000,
                     "seq": 32768, "rope_theta": 1e6, "dtype": "bf16"},
    # mistralai/Mixtral-8x22B-v0.1's config.json: 64k context, vocabulary 32,768.
    "mixtral-8x22b": {"layers": 56, "hidden": 6144, "heads": 48, "kv_heads": 8,
                      "expert_ffn": 16384, "experts": 8, "top_k": 2, "vocab": 32768,
                      "seq": 65536, "rope_theta": 1e6, "dtype": "bf16"},
    # Qwen3 technical report (Yang et al. 2025), Table 2, and Qwen/Qwen3-30B-A3B's
    # config.json: 128 experts of width 768, 8 active, no shared expert; heads 128 wide
    # (32 x 128 = 4096 query features on a 2,048 stream), q and k normalised per head.
    "qwen3-30b-a3b": {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
                      "head_dim": 128, "qk_norm": True, "expert_ffn": 768, "experts": 128,
                      "top_k": 8, "vocab": 151936, "seq": 32768, "rope_theta": 1e6,
                      "norm_eps": 1e-6, "dtype": "bf16"},
    # DeepSeek-V3's sizes (DeepSeek-AI 2024, section 4.2): 61 layers, the first 3 dense
    # (width 18,432), then 256 routed experts of width 2,048 (8 active) and 1 shared; 4k
    # pre-training context. Its attention is multi-head latent attention with sigmoid
    # routing scores; here it is llama's (128 heads, one k/v head per head) with softmax
    # scores, so its parameters and FLOPs per token differ from the published 671B/37B.
    "deepseek-v3-size": {"layers": 61, "hidden": 7168, "heads": 128, "kv_heads": 128,
                         "ffn": 18432, "expert_ffn": 2048, "experts": 256, "top_k": 8,
                         "shared_experts": 1, "first_dense": 3, "vocab": 129280,
                         "seq": 4096, "rope_theta": 10000.0, "dtype": "bf16"},
}


# The load imbalance of real routing: the most loaded expert's tokens over the mean,
# measured. Wang et al. 2024 (DeepSeek-AI, "Auxiliary-Loss-Free Load Balancing Strategy
# for Mixture-of-Experts", arXiv 2408.15664, Table 1) report MaxVio_global = max load /
# mean load - 1 = 0.72 for their 1B MoE trained with an auxiliary balance loss. An ep
# rank holds experts / ep experts, so its own imbalance is at most the busiest expert's:
# a plan that knows better says so (``imbalance = 1.0`` for a forced-balanced router).
PUBLISHED_IMBALANCE = 1.72

# Where a token's top_k experts lie, as the simulator prices a two-hop dispatch: chosen
# by a router (learned: spread as at uniform choice), or forced by a benchmark's gate to
# token t's top_k consecutive experts from t x top_k on, modulo experts (consecutive: NeMo
# AutoModel's FakeBalancedGate, nemo_automodel/components/moe/layers.py, `indices =
# arange(tokens * top_k).view(-1, top_k) % experts`), which at AutoModel's layouts lie
# on one or two ranks of one node.
ROUTINGS = ("learned", "consecutive")


def routes_consecutively(m: Model) -> bool:
    return m.options.get("routing") == "consecutive"


def routing_imbalance(m: Model) -> float:
    """The busiest ep rank's (token, expert) rows over the mean that the simulator prices:
    the plan's ``imbalance``, else 1 for ``routing = consecutive`` (balanced by
    construction: planc.estimate.mixture.consecutive_holders), else the published
    measurement; with ``capacity = F`` at most F, since no expert takes more than F times
    the mean of a sequence's rows."""
    given = m.options.get("imbalance")
    imbalance = float(given) if given is not None else \
        1.0 if routes_consecutively(m) else PUBLISHED_IMBALANCE
    capacity = m.options.get("capacity")
    return imbalance if capacity is None else min(imbalance, float(capacity))


def layer_block(m: Model, layer: int) -> tuple[tuple[str, ...], tuple]:
    if layer < m.first_dense:
        return DENSE_OPS, DENSE_LINKS
    return MOE_OPS, MOE_LINKS


def widths(m: Model) -> dict[str, int]:
    return {**llama.widths(m), "router": m.experts}


def feature_groups(m: Model) -> dict[str, tuple[int, ...]]:
    return llama.feature_groups(m)


def expert_flops(tokens: float, hidden: int, width: int) -> float:
    """One SwiGLU of ``width`` over ``tokens``: gate and up, the product, down."""
    return 2.0 * tokens * hidden * 2 * width + 5.0 * tokens * width + \
        2.0 * tokens * width * hidden


def part_flops(m: Model, hidden: int) -> dict[str, float]:
    """The forward FLOPs per token of each part of a mixture, as schedule
    { overlap_all_to_all } cuts it (planc.passes.split_dispatch): the router (its GEMM,
    softmax or sigmoid and top-k), the shared experts, the routed experts with their
    weighting, and the sum (nothing it counts)."""
    e = m.expert_ffn
    return {"moe_route": 2.0 * hidden * m.experts + 5.0 * m.experts,
            "moe_shared": m.shared_experts * expert_flops(1, hidden, e),
            "moe_experts": m.top_k * expert_flops(1, hidden, e) + 2.0 * hidden * m.top_k,
            "moe_combine": 0.0}


def forward_flops(op: str, s) -> float:
    if op != "moe":
        return llama.forward_flops(op, s)
    # the router, each token through its k experts, weighted and summed, and the shared
    return s.batch * s.seq * sum(part_flops(s.model, s.hidden).values())


def layer_parameters(m: Model, layer: int) -> list[Parameter]:
    dense = llama.layer_parameters(m, layer)
    if layer < m.first_dense:
        return dense
    prefix = f"layers.{layer}."
    h, e, n = m.hidden, m.expert_ffn, m.experts
    shapes = [("router.weight", (h, n), ("hidden", "experts")),
              ("experts.gate.weight", (n, h, e), ("experts", "hidden", "expert_ffn")),
              ("experts.up.weight", (n, h, e), ("experts", "hidden", "expert_ffn")),
              ("experts.down.weight", (n, e, h), ("experts", "expert_ffn", "hidden"))]
    if m.shared_experts:
        s = m.shared_experts * e
        shapes += [("shared.gate.weight", (h, s), ("hidden", "shared_ffn")),
                   ("shared.up.weight", (h, s), ("hidden", "shared_ffn")),
                   ("shared.down.weight", (s, h), ("shared_ffn", "hidden"))]
    attention = [p for p in dense if p.name.split(".", 2)[-1] not in
                 ("gate.weight", "up.weight", "down.weight")]
    return attention + [Parameter(prefix + name, shape, dims, layer)
                        for name, shape, dims in shapes]


def model_flops_per_token(m: Model, attention=llama.attention_flops_per_token) -> float:
    """Narayanan et al. 2021's count with the active experts in place of the MLP;
    ``attention(m)``: a block's attention, llama's or another family's."""
    attention = attention(m)
    dense = 6 * m.hidden * m.ffn
    mixture = 2 * m.hidden * m.experts + \
        (m.top_k + m.shared_experts) * 6 * m.hidden * m.expert_ffn
    moe_layers = m.layers - m.first_dense
    return m.layers * attention + m.first_dense * dense + moe_layers * mixture + \
        2 * m.hidden * m.vocab


def cut_at_all_to_alls(plan) -> bool:
    """Whether a plan's mixtures over ep run cut at their all-to-alls, as transfers of
    their own (planc.passes.split_dispatch): with ``schedule { overlap_all_to_all }``,
    or the two-hop dispatcher."""
    return plan.schedule.overlap_all_to_all or plan.optimize.moe_dispatcher == "two_hop"


def cut_over_ep(plan) -> bool:
    """Whether the plan has mixtures over ep and runs them cut at their all-to-alls
    (:func:`cut_at_all_to_alls`): their route, experts and shared experts pieces each a
    step of its own."""
    return plan.mesh.ep > 1 and bool(getattr(plan.model, "experts", 0)) and \
        cut_at_all_to_alls(plan)


def expert_counts_bytes(experts: int) -> int:
    """What a rank sends in the all-to-all of counts that sizes a dispatch (before every
    forward one, and a recomputed one): how many of its rows go to each expert, one int64
    an expert, each member of the ep group receiving those of its own experts; the rows
    then arrive sorted by expert, so their experts need no exchange of their own
    (Megatron-Core's all-to-all token dispatcher exchanges its tokens per expert so)."""
    return experts * 8


def dispatch_bytes(m: Model, mesh, tokens: float) -> float:
    """A mixture's dispatch buffers when routing is as uneven as it can be: with ep > 1,
    a rank may receive from each of the ep ranks of its group every row of its tokens
    that can go to its experts, min(top_k, experts / ep) per token (over tp each rank
    dispatches tokens / tp), and holds them, the experts' gate, up and product on them
    and their outputs at once; with ``capacity``, at most its experts' capacity of every
    sequence each of the ep ranks holds a part of. Node-limited routing does not lower
    it: it limits the nodes a token reaches, not the rows one rank's experts take."""
    if mesh.ep == 1 or m.first_dense >= m.layers:
        return 0.0
    local = tokens / mesh.tp
    rows = mesh.ep * local * min(m.top_k, m.experts // mesh.ep)
    per_sequence = expert_capacity(m)
    if per_sequence is not None:
        # each of the rank's experts takes at most C rows of a sequence, from whichever
        # ranks hold its parts: a rank holds parts of tokens x cp / seq sequences
        sequences = tokens * mesh.cp / m.seq
        rows = min(rows, mesh.ep * sequences * (m.experts // mesh.ep) * per_sequence)
    return rows * _row_bytes(m)


def priced_dispatch_bytes(m: Model, mesh, tokens: float) -> float:
    """The dispatch buffers at the imbalance the simulator prices
    (:func:`routing_imbalance`: the busiest rank takes that many times the mean,
    top_k rows per token), at most :func:`dispatch_bytes`. The memory estimate holds
    this: DeepSeek-V3 trained dropless on 80 GB H800s, which the worst case (every row
    of the ep group on one rank's experts, tens of GB at its sizes) would not allow;
    that worst case is reported beside it."""
    mean = tokens / mesh.tp * m.top_k
    return min(dispatch_bytes(m, mesh, tokens),
               routing_imbalance(m) * mean * _row_bytes(m))


def _row_bytes(m: Model) -> float:
    """A dispatched row's input and output, and the gate, up and product on it."""
    return (2 * m.hidden + 3 * m.expert_ffn) * m.dtype_bytes


def mixture_keys(presets) -> dict[str, Key]:
    """The mixture's own keys, their defaults read from ``presets`` (a family built on
    this one, DeepSeek-V3's, passes its own)."""
    def given(name: str):
        return llama.preset_default(name, presets)

    def or_else(name: str, fallback):
        return llama.or_fallback(name, fallback, presets)

    return {
        "ffn": Key(Integer(1), or_else("ffn", lambda scope: scope.value("expert_ffn")),
                   doc="SwiGLU width of the dense blocks before first_dense (default: "
                       "expert_ffn)"),
        "experts": Key(Integer(1), given("experts"), doc="routed experts per block"),
        "top_k": Key(Integer(1), given("top_k"), doc="experts each token is routed to"),
        "expert_ffn": Key(Integer(1), given("expert_ffn"), doc="SwiGLU width of one expert"),
        "shared_experts": Key(Integer(0), or_else("shared_experts", 0),
                              doc="experts every token goes through, unweighted"),
        "first_dense": Key(Integer(0), or_else("first_dense", 0),
                           doc="blocks, from the first, with a dense SwiGLU of width ffn"),
        "norm_topk": Key(Boolean(), True, doc="renormalise each token's k routing weights to "
                                              "sum to 1"),
        "aux_loss": Key(Real(0.0, None), 0.0, doc="weight of DeepSeek-V3's sequence-wise "
                                                  "load-balancing loss"),
        # written only when set: a plan, build or checkpoint without them is the softmax gate
        "score": Key(Choice(("softmax", "sigmoid")), None, optional=True,
                     doc="the router's scores: softmax probabilities (Mixtral, Qwen3) or "
                         "DeepSeek-V3's sigmoid affinities [softmax]"),
        "expert_groups": Key(Integer(1), None, optional=True,
                             doc="groups of experts, each a contiguous block of experts / "
                                 "expert_groups (DeepSeek-V3: one a node, 8) [1]"),
        "route_groups": Key(Integer(1), None, optional=True,
                            doc="groups each token's experts are chosen from (DeepSeek-V3's "
                                "node-limited routing, 4) [every group]"),
        "routed_scale": Key(Real(0.0, None, minimum_allowed=False), None, optional=True,
                            doc="factor of the routed experts' weights (DeepSeek-V3's routed "
                                "scaling factor, 2.5) [1]"),
        "bias_update": Key(Real(0.0, None), None, optional=True,
                           doc="DeepSeek-V3's auxiliary-loss-free balancing: each expert's "
                               "routing bias, added to its score to choose the top_k (never "
                               "to weigh them), moves by this much after every step, up for "
                               "an expert the step's tokens chose less than the mean, down "
                               "for one chosen more (gamma, 0.001); 0 keeps it fixed [no "
                               "bias]"),
        "capacity": Key(Real(0.0, None, minimum_allowed=False), None, optional=True,
                        doc="expert capacity factor F: each expert takes the first ceil(F x "
                            "seq x top_k / experts) tokens of each sequence that chose it, the "
                            "others' (token, expert) pairs are dropped (GShard; Megatron-Core's "
                            "moe_expert_capacity_factor, position policy) [dropless]"),
        "imbalance": Key(Real(1.0, None), None, optional=True,
                         doc="the busiest ep rank's routed tokens over the mean, as the "
                             "simulator prices the mixture (default: "
                             f"{PUBLISHED_IMBALANCE:g}, measured; 1 with routing = "
                             "consecutive; training routes for real)"),
        "routing": Key(Choice(ROUTINGS), None, optional=True,
                       doc="where the simulator takes a token's top_k experts to lie: "
                           "spread over the experts as a router chooses them (learned), or "
                           "token t's the top_k from t x top_k on (mod experts), a "
                           "benchmark's forced balance (consecutive: NeMo AutoModel's fake "
                           "balanced gate); training routes for real [learned]"),
    }


_LLAMA = llama.preset_keys(PRESETS)  # llama's keys, defaulting to these presets
_OWN = mixture_keys(PRESETS)
# The order the plan text shows them in: llama's up to the batch, the mixture's, the rest.
KEY_ORDER = (
    "preset", "layers", "hidden", "heads", "kv_heads", "head_dim", "qk_norm", "ffn", "vocab",
    "seq",
    "batch", "experts", "top_k", "expert_ffn", "shared_experts", "first_dense", "norm_topk",
    "score", "routed_scale", "expert_groups", "route_groups", "bias_update", "capacity",
    "aux_loss", "imbalance", "routing",
    "dtype", "fp8", "fp8_tile", "fp8_gradients", "rope_theta", "norm_eps",
    "tie_embeddings")
KEYS = {name: _OWN.get(name) or _LLAMA[name] for name in KEY_ORDER}


def top_k_within_experts(m: Model) -> Finding | None:
    if m.top_k <= m.experts:
        return None
    return Finding(f"top_k ({m.top_k}) must be at most experts ({m.experts}): each token "
                   f"goes to top_k different experts", ("model.top_k", "model.experts"),
                   try_values("top_k", [k for k in (1, 2, m.experts) if k <= m.experts]))


def imbalance_within_experts(m: Model) -> Finding | None:
    """The busiest expert takes each token at most once: experts / top_k times the mean
    of its top_k x tokens slots over the experts, the most ``imbalance`` can be."""
    given = m.options.get("imbalance")
    most = m.experts / m.top_k
    if given is None or m.top_k > m.experts or float(given) <= most:
        return None
    return Finding(f"imbalance ({float(given):g}) must be at most experts / top_k ({most:g}): "
                   f"the busiest expert takes each token at most once",
                   ("model.imbalance",),
                   f"try imbalance = {PUBLISHED_IMBALANCE:g}, the published measurement"
                   if PUBLISHED_IMBALANCE <= most else f"try imbalance = {most:g}")


def groups_of_experts(m: Model) -> Finding | None:
    """DeepSeek-V3's group-limited routing: whole groups, and enough experts in the groups a
    token may use for its top_k."""
    limited = expert_groups_of(m)
    if limited is None:
        return None
    groups, chosen = limited
    if m.experts % groups:
        return Finding(f"expert_groups ({groups}) must divide experts ({m.experts}): each "
                       f"group is a block of experts / expert_groups experts",
                       ("model.expert_groups",), try_values("expert_groups",
                                                            divisors_below(groups, m.experts)))
    if chosen > groups:
        return Finding(f"route_groups ({chosen}) must be at most expert_groups ({groups})",
                       ("model.route_groups",), try_values("route_groups", [groups]))
    if m.top_k > chosen * (m.experts // groups):
        return Finding(f"top_k ({m.top_k}) must be at most the experts of route_groups "
                       f"groups ({chosen} x {m.experts // groups})",
                       ("model.top_k", "model.route_groups"), None)
    return None


def first_dense_within_layers(m: Model) -> Finding | None:
    if m.first_dense <= m.layers:
        return None
    return Finding(f"first_dense ({m.first_dense}) must be at most layers ({m.layers}): it "
                   f"counts the dense blocks before the first mixture of experts",
                   ("model.first_dense",), try_values("first_dense", [0, m.layers]))


def ep_divides_the_stage_and_the_experts(m: Model, mesh) -> Finding | None:
    """Expert parallelism folded over a stage's ranks (Megatron-Core's MoE Parallel
    Folding, arXiv 2504.14960): ep ranks drawn from tp x cp x dp, each holding
    experts / ep experts."""
    stage = mesh.tp * mesh.cp * mesh.dp
    if stage % mesh.ep:
        return Finding(f"ep ({mesh.ep}) must divide the ranks of a pipeline stage, tp x cp "
                       f"x dp = {stage}: its groups are drawn from them",
                       ("mesh.ep",), try_values("ep", divisors_below(mesh.ep, stage)))
    if m.experts % mesh.ep:
        return Finding(f"ep ({mesh.ep}) must divide experts ({m.experts}): each rank of an "
                       f"ep group holds experts / ep of them", ("mesh.ep",),
                       try_values("ep", divisors_below(mesh.ep, stage, m.experts)))
    return None


FAMILY = Family(
    name="moe",
    summary="Mixture of experts: llama's attention, top-k routed SwiGLU experts, shared "
            "experts, dense first blocks",
    layer_ops=MOE_OPS,
    layer_links=MOE_LINKS,
    embedding_ops=EMBEDDING_OPS,
    head_ops=HEAD_OPS,
    chains={**pre_norm_chains(EMBEDDING_OPS, DENSE_OPS), "moe": MOE_OPS[5:]},
    rules=RULES,
    output_tensor=OUTPUT_TENSOR,
    placements=llama.FAMILY.placements,
    global_parameters=llama.FAMILY.global_parameters,
    widths=widths,
    feature_groups=feature_groups,
    forward_flops=forward_flops,
    layer_parameters=layer_parameters,
    embedding_parameters=llama.embedding_parameters,
    head_parameters=llama.head_parameters,
    model_flops_per_token=model_flops_per_token,
    activation_bytes=moe_memory.activation_bytes,
    input_half_bytes=moe_memory.input_half_bytes,
    gathered_kv_width=llama.gathered_kv_width,  # llama's attention
    keys=KEYS,
    presets=PRESETS,
    model_checks=(llama.kv_heads_divide_heads, llama.head_dim_even, top_k_within_experts,
                  first_dense_within_layers, groups_of_experts, imbalance_within_experts),
    tensor_parallel_checks=(llama.kv_heads_split_over_tp, llama.fp8_blocks_split_over_tp),
    mesh_checks=(ep_divides_the_stage_and_the_experts,),
    hf_architecture="MixtralForCausalLM",  # without shared experts or dense blocks
    layer_block=layer_block,
    transient_bytes=priced_dispatch_bytes,
    worst_transient_bytes=dispatch_bytes,
    module_kernels=llama.MODULE_KERNELS,
)

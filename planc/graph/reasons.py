"""One sentence for every transfer: which producer, which consumer, which layouts, why.

These sentences are what ``planc explain`` shows and what every transfer node carries
as its ``reason`` attribute, so that "why is there an all-gather here?" has an answer.
"""

from __future__ import annotations

from planc.graph.sharding import Layout, Redistribution
from planc.models import family_of
from planc.plan.plan import Plan
from planc.schedules.layers import chunk_text

_PLACEMENT_WORDS = {"column": "column-parallel", "row": "row-parallel",
                    "replicate": "replicated", "vocab": "vocabulary-parallel",
                    "hidden": "split by hidden features"}

# Operators of these kinds (planc.models.family.OpRule) work on the residual stream: a
# norm, a residual add, the position embedding's add.
_RESIDUAL_STREAM_KINDS = ("norm", "residual", "position")


def _layout_words(layout: Layout) -> str:
    if layout.kind == "R":
        return "replicated (R)"
    if layout.kind == "P":
        return "a partial sum (P)"
    return f"sharded along {layout.dim} (S({layout.dim}))"


def _why(plan: Plan, op: str, side: str) -> str:
    """Why ``op`` produces or needs its layout: its placement, or the residual stream."""
    tensor = plan.shard.tp
    rule = family_of(plan).rules.get(op)
    kind = rule.kind if rule is not None else None
    if rule is not None and rule.placement is not None:
        placement = getattr(tensor, rule.placement)
        return f"{op} is {_PLACEMENT_WORDS[placement]} over tp ({rule.placement} = {placement})"
    if kind in _RESIDUAL_STREAM_KINDS and tensor.sequence_parallel:
        return f"{op} works on the residual stream, sequence-parallel over tp"
    if kind in _RESIDUAL_STREAM_KINDS:
        return f"{op} works on the residual stream, replicated over tp"
    return f"{op} runs {'on whole heads' if kind == 'attention' else 'elementwise'}"


def tensor_parallel(plan: Plan, tpp, names: tuple[str, str], move: Redistribution,
                    backward: bool, recompute: bool = False) -> str:
    """Reason of a tp redistribution between two operators (forward or backward)."""
    producer, consumer = names
    if not backward:
        text = (f"{_why(plan, producer, 'out')}, so its output is "
                f"{_layout_words(move.source)}; {consumer} needs it "
                f"{_layout_words(move.target)}: {move.kind.replace('_', '-')} over tp")
        if recompute:
            text = "recomputing the layer's forward (recompute = full): " + text
        return text
    # Backward: ``producer`` here is the operator whose input gradient flows back.
    return (f"backward of {consumer} -> {producer}: {_why(plan, producer, 'in')}, so the "
            f"gradient it returns for its input is {_layout_words(move.source)}; "
            f"{consumer}'s output gradient must be {_layout_words(move.target)}: "
            f"{move.kind.replace('_', '-')} over tp")


def regather(plan: Plan, consumer: str) -> str:
    """Reason of a backward all-gather of a column-parallel GEMM's input."""
    return (f"{consumer}'s weight gradient reads its input whole, which sequence "
            f"parallelism all-gathered over tp in the forward; the forward kept only this "
            f"rank's shard (gathered_inputs = regather, as Megatron-LM does: Korthikanti "
            f"et al. 2022, section 4.2.2): all-gather it again over tp")


def vocab_loss(plan: Plan, part: str) -> str:
    what = {"max": "the maximum logit of each token",
            "sum_exp": "the sum of exponentials of each token's logits"}[part]
    return (f"the head is vocabulary-parallel (head = {plan.shard.tp.head}), so each tp rank "
            f"holds a slice of the logits; cross-entropy needs {what}: an all-reduce of one "
            f"fp32 number per token over tp, never a gather of the logits")


def loss_report(plan: Plan) -> str:
    where = "the last stage" if plan.head_stage == plan.mesh.pp - 1 else \
        f"stage {plan.head_stage}, which holds the head"
    return ("the mean loss reported for the step sums the partial losses of every rank of "
            f"{where} (tp x cp x dp): one fp32 all-reduce per step")


def context_allgather(plan: Plan, backward: bool, recompute: bool = False) -> str:
    if backward:
        return ("backward of the cp all-gather: each rank's keys and values received "
                "gradient from every rank's queries, reduce-scattered over cp")
    text = ("attention needs the keys and values of every earlier token, but tokens are "
            "sharded along seq over cp (attention = allgather): all-gather K and V over cp")
    return ("recomputing attention's input (recompute = full): " + text) if recompute else text


def context_ring(plan: Plan, forward: bool) -> str:
    cp = plan.mesh.cp
    if forward:
        return (f"ring attention (attention = ring): {cp} ring steps per layer and "
                f"microbatch; at each step but the last the K/V block in hand goes to the "
                f"next cp rank while attention runs on it ({cp - 1} shifts)")
    return (f"ring attention backward: {cp} ring steps; the K/V blocks travel again "
            f"({cp - 1} shifts) and each block's dK/dV accumulator travels with it and comes "
            f"home ({cp} shifts), each shift overlapped with the next block's gradients")


def pipeline(plan: Plan, phase: str, source_chunk: int, target_chunk: int,
             scattered: int = 1) -> str:
    def where(chunk: int) -> str:
        return f"{chunk_text(plan.shard.pp.chunks, chunk)} (stage {plan.stage_of_chunk(chunk)})"

    # Forward goes to the next stage and backward to the previous, except on the way back
    # of a V (zbv, dualpipev), where both turn round.
    descends = plan.placement.descends(min(source_chunk, target_chunk), plan.mesh.pp)
    toward = "previous" if descends == (phase == "forward") else "next"
    split = (f"; each tp rank sends its 1/{scattered} of the tokens (pp_scatter_gather = "
             f"on)") if scattered > 1 else ""
    if phase == "forward":
        return (f"{where(source_chunk)} feeds {where(target_chunk)}: each microbatch's "
                f"activation is sent to the {toward} stage{split}")
    return (f"{where(target_chunk)} needs the gradient of its output from "
            f"{where(source_chunk)}: each microbatch's gradient is sent to the {toward} "
            f"stage{split}")


def scatter_gather_decision(plan: Plan, stream_split: bool) -> str:
    tp, pp = plan.mesh.tp, plan.mesh.pp
    if not plan.optimize.pp_scatter_gather:
        return "pp_scatter_gather = off: every tp rank sends the whole activation"
    if tp == 1 or pp == 1:
        return f"nothing to split: tp = {tp}, pp = {pp}"
    if stream_split:
        return ("sequence parallelism already splits the activation between stages over "
                "tp: each tp rank sends its own tokens, nothing more to do")
    return (f"each of the {tp} tp ranks sends 1/{tp} of the activation (and of its "
            f"gradient) to the next stage, which all-gathers it over tp inside its node: "
            f"the bytes between stages drop by {tp} (Narayanan et al. SC'21, 4.1)")


def scatter_gather(plan: Plan, phase: str) -> str:
    what = "activation" if phase == "forward" else "gradient"
    return (f"pp_scatter_gather = on: the {what} arrived as each tp rank's 1/{plan.mesh.tp} "
            f"of the tokens; all-gather it over tp, inside the node, to have it whole "
            f"(Narayanan et al. SC'21, 4.1)")


def _replicas_words(plan: Plan, axis: str) -> tuple[str, str]:
    """(the group's name, its members in words) of the group a gradient is reduced over:
    dp x cp, or with mesh { ep } an expert's replicas (the expert-data-parallel group)."""
    m = plan.mesh
    if axis == "edp":
        return "edp", (f"the {m.tp * m.cp * m.dp // m.ep} ranks of the stage holding the same "
                       f"experts (tp x cp x dp / ep = {m.tp * m.cp * m.dp} / {m.ep})")
    who = f"dp x cp = {m.dp} x {m.cp}" if m.cp > 1 else f"dp = {m.dp}"
    return "dp x cp", f"{who} ranks"


def data_parallel(plan: Plan, param: str, kind: str, axis: str = "dp_cp") -> str:
    group, who = _replicas_words(plan, axis)
    zero = plan.shard.dp.zero
    if kind == "all_reduce" and zero == 1:
        return (f"{param}'s gradient is summed over {who} and each keeps only its shard "
                f"(zero 1, grad_reduce = all_reduce): all-reduce the whole gradient over "
                f"{group}, once per step, and keep the shard")
    if kind == "all_reduce":
        return (f"{param} is replicated on {who} that each computed its gradient on "
                f"their own data (zero 0): all-reduce the gradient over {group}")
    when = "once per step" if zero == 1 else "after every microbatch"
    replicas = f"the {plan.mesh.dp * plan.mesh.cp} replicas" if axis == "dp_cp" else who
    return (f"{param}'s gradient is summed over {replicas} and each keeps only its shard "
            f"(zero {zero}): reduce-scatter over {group}, {when}")


def zero_gather(plan: Plan, param: str, axis: str = "dp_cp") -> str:
    group = _replicas_words(plan, axis)[0]
    return (f"each {group} rank updated only its shard of {param} (zero "
            f"{plan.shard.dp.zero}): all-gather the updated parameter for the next step")


def zero3_gather(plan: Plan, param: str, phase: str, axis: str = "dp_cp",
                 kept: bool = False) -> str:
    group = _replicas_words(plan, axis)[0]
    if kept:
        return (f"{param} is stored sharded over {group} (zero 3): all-gather it before its "
                f"forward use, every microbatch, and keep it whole for its backward, which "
                f"follows at once on the head's stage (as FSDP keeps its root module and "
                f"torchtitan the last block)")
    return (f"{param} is stored sharded over {group} (zero 3): all-gather it before its "
            f"{phase} use, every microbatch")


def tied(plan: Plan) -> str:
    return ("the head on the last stage shares embedding.weight with the embedding on the "
            "first stage (tie_embeddings = on): their two gradients are summed by an "
            "all-reduce between the two stages before the optimizer step")


def parameter_fixup(plan: Plan, param: str, move: Redistribution, data: Layout) -> str:
    if move.kind == "all_reduce" and not data.is_sharded:
        return (f"{param} is replicated over tp and read by every token, but only through "
                f"the rank's own heads, so each rank's gradient is a partial sum (P): "
                f"all-reduce over tp")
    if move.kind == "all_reduce":
        return (f"{param} is replicated over tp but applied to data {_layout_words(data)}, "
                f"so each rank's gradient covers only its share of the tokens (P): "
                f"all-reduce over tp")
    return (f"{param} is replicated over tp but each rank uses only its slice along "
            f"{data.dim}, so each rank's gradient covers only that slice: all-gather over tp")


def _members_text(bucket: dict) -> str:
    names = [m["param"] for m in bucket["members"]]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(names)} parameter{'s' if len(names) > 1 else ''} ({shown})"


def bucket(plan: Plan, bucket_id: str, info: dict, kind: str, axis: str, phase: str,
           kept: bool = False) -> str:
    """Reason of a fused bucket's collective (see planc.passes.fuse); ``kept``: a ZeRO-3
    forward gather its backward reads too (planc.estimate.memory.head_unit_kept)."""
    what = f"bucket {bucket_id} packs {_members_text(info)} into one flat buffer"
    if axis == "tp":
        return (f"{what}; the first {info['tp_sum_numel']:,} elements are gradients of "
                f"parameters replicated over tp but applied to data split over tp, or read "
                f"only through the rank's own heads (partial sums): one all-reduce over tp "
                f"sums them all")
    group = _replicas_words(plan, axis)[0]
    if kind == "all_gather" and phase == "optimizer":
        return (f"{what}; each {group} rank updated its shard of the bucket (zero "
                f"{plan.shard.dp.zero}): one all-gather of the bucket for the next step")
    if kind == "all_gather" and kept:
        return (f"{what} stored sharded over {group} (zero 3): one all-gather of the bucket "
                f"before its forward use, every microbatch, kept whole for its backward, "
                f"which follows at once on the head's stage (as FSDP keeps its root module "
                f"and torchtitan the last block)")
    if kind == "all_gather":
        return (f"{what} stored sharded over {group} (zero 3): one all-gather of the bucket "
                f"before its {phase} use, every microbatch")
    if kind == "all_reduce" and plan.shard.dp.zero == 1:
        return (f"{what}; each {group} rank keeps only its equal slice of the summed "
                f"gradient (zero 1, grad_reduce = all_reduce): one all-reduce of the whole "
                f"bucket over {group}, once per step, and each keeps its slice")
    if kind == "all_reduce":
        return (f"{what}; its gradients were computed by every {group} replica on its own "
                f"data (zero 0): one all-reduce of the bucket over {group}")
    when = "once per step" if plan.shard.dp.zero == 1 else "after every microbatch"
    return (f"{what}; each {group} rank keeps only its equal slice of the summed gradient "
            f"(zero {plan.shard.dp.zero}): one reduce-scatter of the bucket over {group}, "
            f"{when}")


def grad_norm(plan: Plan) -> str:
    """Reason of the gradient norm's all-reduce (planc.graph.grad_norm)."""
    m = plan.mesh
    ranks = f"all {m.world} ranks" if m.world > 1 else "its one rank"
    return (f"grad_clip = {plan.train.grad_clip:g} clips every gradient by their global L2 "
            f"norm (torch.nn.utils.clip_grad_norm_), a sum over every parameter's shards "
            f"on every stage: each rank sums the squares of the gradients it holds once "
            f"they are reduced, a value replicated on k ranks weighted 1/k, and one "
            f"all-reduce of that fp64 number over {ranks} (tp x cp x pp x dp = "
            f"{m.tp} x {m.cp} x {m.pp} x {m.dp}) gives every rank the same norm before "
            f"any optimizer step")


def router_load(plan: Plan, blocks: int) -> str:
    """Reason of the balancing bias's all-reduce of the expert loads
    (planc.graph.router_bias)."""
    m = plan.mesh
    return (f"bias_update = {plan.model.options['bias_update']:g}: DeepSeek-V3's "
            f"auxiliary-loss-free balancing moves each expert's routing bias by the sign of "
            f"(mean load - its load) over the step's whole batch; each rank counts the "
            f"experts its tokens chose in the stage's {blocks} mixture block"
            f"{'s' if blocks != 1 else ''}, and one all-reduce of those counts over the "
            f"stage's {m.tp * m.cp * m.dp} ranks (tp x cp x dp = {m.tp} x {m.cp} x {m.dp}) "
            f"gives every rank the same loads, so that every copy of the bias moves alike")

"""The model table of a plan (:class:`planc.program.model_table.ModelTable`): the compiler's
side, which reads the plan and the model's family (planc.models) so that the runtime
does not have to."""

from __future__ import annotations

from planc.hf.init import init_buffers, init_sources
from planc.lower.evaluation import evaluation_of
from planc.program.model_table import Initial, InitTable, ModelTable, OptimizerSettings
from planc.plan.lr_schedule import LrSchedule
from planc.models import family_of, recomputes_norms
from planc.plan.plan import Plan

# Matrices and embeddings are N(0, 0.02) as in GPT-2; norm weights 1 + N(0, 0.02) and
# biases N(0, 0.02), so that every parameter already matters in the first step.
INIT_STD = 0.02


def initial_mean(name: str) -> float:
    """1 for a norm's weight (``layers.I.ln1.weight``, ``final_ln.weight``, a head's
    ``q_norm.weight``), else 0."""
    parts = name.split(".")
    return 1.0 if len(parts) > 1 and (parts[-2].startswith(("ln", "final_ln"))
                                      or parts[-2].endswith("_norm")) and \
        parts[-1] == "weight" else 0.0


def cp_positions(seq: int, cp: int, load_balance: bool
                 ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The [start, stop) ranges of sample positions each cp rank holds, in its order.

    With load balancing the sequence is cut into 2 cp chunks and rank i holds chunks i
    and 2 cp - 1 - i, so causal attention costs every rank the same (as Megatron's
    context parallelism does)."""
    if cp == 1:
        return (((0, seq),),)
    if load_balance:
        size = seq // (2 * cp)
        return tuple(((i * size, (i + 1) * size),
                      ((2 * cp - 1 - i) * size, (2 * cp - i) * size)) for i in range(cp))
    size = seq // cp
    return tuple((((i * size, (i + 1) * size)),) for i in range(cp))


def model_table(plan: Plan) -> ModelTable:
    m, family = plan.model, family_of(plan)
    o = plan.train.optimizer
    return ModelTable(
        family=m.family, layers=m.layers, hidden=m.hidden, heads=m.heads,
        key_value_heads=m.key_value_heads, head_dim=m.head_dim, vocab=m.vocab, seq=m.seq,
        batch=m.batch, dtype=m.dtype, tie_embeddings=m.tie_embeddings,
        norm_eps=float(m.norm_eps), rope_theta=float(m.rope_theta),
        feature_groups={k: tuple(v) for k, v in family.feature_groups(m).items()},
        positions=cp_positions(m.seq, plan.mesh.cp, plan.shard.cp.load_balance),
        rows_per_dp_rank=m.batch // plan.mesh.dp, microbatch_rows=plan.microbatch_size,
        optimizer=OptimizerSettings(o.name, float(o.lr), float(o.momentum),
                                    (float(o.betas[0]), float(o.betas[1])), float(o.eps),
                                    float(o.weight_decay)),
        data=plan.train.data, seed=plan.train.seed,
        parameters={p.name: Initial(tuple(p.shape), initial_mean(p.name), INIT_STD)
                    for p in family.all_parameters(m)},
        options=dict(m.options), evaluation=evaluation_of(plan), shuffle=plan.train.shuffle,
        init=init_table(plan), compile_kernels=plan.optimize.compile,
        recompute_moe_activation=plan.recomputes_moe_activation,
        recompute_activation=plan.recomputes_activation,
        recompute_norms=recomputes_norms(plan),
        # the steps only with a schedule, which spans them (model.json writes both or none)
        **({"lr_schedule": plan.train.lr_schedule, "steps": plan.train.steps}
           if plan.train.lr_schedule != LrSchedule() else {}))


def init_table(plan: Plan) -> InitTable | None:
    """Where each parameter starts in the plan's Hugging Face checkpoint (train.init),
    from the export's own table of tensors (planc.hf.init)."""
    if plan.train.init is None:
        return None
    saved = plan.train.init_form == "saved"
    sources, tensors = init_sources(plan.model, saved)
    return InitTable(plan.train.init, tensors, sources, init_buffers(plan.model, saved))

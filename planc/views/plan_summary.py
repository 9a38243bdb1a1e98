"""A validated plan as text: a one-line summary and the resolved settings."""

from __future__ import annotations

from planc.estimate import memory
from planc.vocabulary.units import COMPUTE, RATE, TIME, format_bytes, format_quantity
from planc.models import family_of
from planc.plan.data_source import blend_of
from planc.plan.lr_schedule import SCHEDULE_ARGUMENTS
from planc.plan.plan import Plan
from planc.schedules.layers import range_text
from planc.diagnostics import counted


def _onoff(flag: bool) -> str:
    return "on" if flag else "off"


def _value_text(value) -> str:
    """A family's own key as the plan text shows it: on/off, 500000, 1e-05."""
    if isinstance(value, bool):
        return _onoff(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _count(n: int) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def one_line(plan: Plan, path: str) -> str:
    mesh, topo = plan.mesh, plan.topology
    estimate = memory.estimate(plan)
    return (f"{path}: ok: plan {plan.name}, {_count(memory.total_parameters(plan))} parameters, "
            f"{counted(mesh.world, 'rank')} (tp {mesh.tp} x cp {mesh.cp} x "
            f"pp {mesh.pp} x dp {mesh.dp}) on {topo.nodes} x {topo.devices_per_node} devices, "
            f"{format_bytes(estimate.peak.total_bytes)} per device at peak"
            + (f" ({counted(len(plan.sources.overrides), 'override')} applied)"
               if plan.sources.overrides else ""))


def settings(plan: Plan) -> str:
    m, mesh, topo, shard = plan.model, plan.mesh, plan.topology, plan.shard
    opt, tr, o = plan.optimize, plan.train, plan.train.optimizer
    if o.name == "adamw":
        optimizer = (f"adamw(lr = {o.lr:g}, betas = [{o.betas[0]:g}, {o.betas[1]:g}], "
                     f"eps = {o.eps:g}, weight_decay = {o.weight_decay:g})")
    else:
        optimizer = f"sgd(lr = {o.lr:g}, momentum = {o.momentum:g}, weight_decay = {o.weight_decay:g})"
    stages = ", ".join(range_text(shard.pp.chunks, c) for c in range(len(shard.pp.chunks)))
    memory_text = "unknown memory" if topo.device.memory is None else format_bytes(topo.device.memory)
    family = family_of(m)
    own = "".join(f", {key} {_value_text(getattr(m, key))}" for key in family.own_keys
                  if not family.keys[key].optional or key in m.options)
    # heads of head_dim features where one linear layer makes them (not multi-head latent
    # attention's, whose widths are its own keys)
    width = f" (head_dim {m.head_dim})" if family.linear_rule("qkv") is not None else ""
    rows = [
        (f"model {m.family}", f"layers {m.layers}, hidden {m.hidden}, heads {m.heads}{width}"
                      f"{own}, ffn {m.ffn}, vocab {m.vocab}, seq {m.seq}, batch {m.batch}, "
                      f"{m.dtype}, tie_embeddings {_onoff(m.tie_embeddings)}; "
                      f"{memory.total_parameters(plan):,} parameters"),
        ("mesh", f"tp {mesh.tp} x cp {mesh.cp} x pp {mesh.pp} x dp {mesh.dp} = "
                 f"{counted(mesh.world, 'rank')}, order [{', '.join(mesh.order)}]"
                 + (f", ep {mesh.ep}" if mesh.ep > 1 else "")),
        ("topology", f"{counted(topo.nodes, 'node')} x "
                     f"{topo.devices_per_node} devices"
                     + (f" ({topo.preset})" if topo.preset else "")
                     + f"; device {format_quantity(topo.device.flops, COMPUTE)}, {memory_text}, "
                       f"bandwidth {format_quantity(topo.device.bandwidth, RATE)}, "
                       f"efficiency {topo.device.efficiency:g}, overlap "
                       f"{topo.device.overlap:g}"),
        ("", f"intra {format_quantity(topo.intra.bandwidth, RATE)} "
             f"{format_quantity(topo.intra.latency, TIME)}; inter "
             f"{format_quantity(topo.inter.bandwidth, RATE)} "
             f"{format_quantity(topo.inter.latency, TIME)}"),
        ("shard tp", f"embedding {shard.tp.embedding}, qkv {shard.tp.qkv}, proj {shard.tp.proj}, "
                     f"fc1 {shard.tp.fc1}, fc2 {shard.tp.fc2}, head {shard.tp.head}, "
                     f"sequence_parallel {_onoff(shard.tp.sequence_parallel)}, "
                     f"gathered_inputs {shard.tp.gathered_inputs}"),
        ("shard cp", f"attention {shard.cp.attention}, load_balance "
                     f"{_onoff(shard.cp.load_balance)}"),
        ("shard pp", f"stages [{stages}]{' (auto)' if shard.pp.auto else ''}, virtual "
                     f"{shard.pp.virtual}"),
        ("shard dp", f"zero {shard.dp.zero}, fp32_grads {_onoff(shard.dp.fp32_grads)}, "
                     f"reduce_dtype {shard.dp.reduce_dtype}, grad_reduce "
                     f"{shard.dp.grad_reduce}"),
        ("schedule", f"{plan.schedule.pipeline}, "
                     f"{counted(plan.schedule.microbatches, 'microbatch', 'microbatches')} of "
                     f"{counted(plan.microbatch_size, 'sequence')} per data-parallel rank"
                     + (", overlap_all_to_all on" if plan.schedule.overlap_all_to_all else "")),
        ("optimize", f"fuse {_onoff(opt.fuse)} (bucket {format_bytes(opt.bucket)}), route "
                     f"{opt.route}, overlap {_onoff(opt.overlap)}, weight_grad_overlap "
                     f"{_onoff(opt.weight_grad_overlap)}, tp_overlap "
                     f"{_value_text(opt.tp_overlap)}, recompute {opt.recompute}, "
                     f"pp_scatter_gather {_onoff(opt.pp_scatter_gather)}, grad_accumulation "
                     f"{opt.grad_accumulation}, kernels {opt.kernels}, moe_dispatcher "
                     f"{opt.moe_dispatcher}, compile {_onoff(opt.compile)}, "
                     f"recompute_moe_activation {_onoff(opt.recompute_moe_activation)}, "
                     f"recompute_activation {_onoff(opt.recompute_activation)}, "
                     f"recompute_norms {_onoff(opt.recompute_norms)}"),
        ("train", f"{counted(tr.steps, 'step')}, {optimizer}, seed {tr.seed}, "
                  f"data {_data(tr.data)}, init {tr.init or 'none'}, shuffle "
                  f"{_onoff(tr.shuffle)}, grad_clip "
                  f"{'off' if tr.grad_clip is None else f'{tr.grad_clip:g}'}"),
        ("", _lr_schedule(tr.lr_schedule) + ", " + _evaluation(tr)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _lr_schedule(schedule) -> str:
    """The lr schedule as the plan writes it: constant, cosine(warmup = 100, ...)."""
    if schedule.is_constant:
        return "lr_schedule constant"
    arguments = ", ".join(f"{key} = {_value_text(getattr(schedule, key))}"
                          for key in SCHEDULE_ARGUMENTS[schedule.name])
    return f"lr_schedule {schedule.name}({arguments})"


def _evaluation(train) -> str:
    if not train.eval_every:
        return "eval_every 0 (no evaluation)"
    return (f"eval_every {train.eval_every}, eval_batches {train.eval_batches}, eval_data "
            f"{_data(train.eval_data)}")


def _data(data: str) -> str:
    """One source's path, or a mixture as its weights and paths."""
    pairs = blend_of(data)
    return data if pairs is None else \
        "mixture of " + ", ".join(f"{weight:g} {path}" for weight, path in pairs)


"""The plans of planc run's --check matrix (tests/test_runtime.py) and how a test runs one:
``planc run`` in the test's own process, so that torch.distributed's launcher starts the
ranks from one fork server per worker process (torch is imported once). Shared by
tests/test_runtime.py, tests/test_runtime_comm.py and tests/test_runtime_data_and_failures.py.
"""

from __future__ import annotations

import json

import pytest

from planc.cli import main

TEMPLATE = """plan {name} {{
  model gpt {{ layers = 4; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 8{model} }}
  mesh {{ {mesh} }}
  topology {{ {topology} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m}{schedule} }}
  optimize {{ {optimize} }}
  train {{ steps = {steps}; optimizer = sgd(lr = 0.5, momentum = 0.9); seed = 3{train} }}
}}
"""

# Each axis alone and combined, Megatron's placements and unusual ones, up to 8 ranks.
MATRIX = {
    "single": dict(mesh=""),
    "tp-megatron": dict(mesh="tp = 2"),
    "tp-sequence-parallel": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
    "tp-fc1-row-fc2-column": dict(mesh="tp = 2", shard="tp { fc1 = row; fc2 = column }"),
    "tp-qkv-replicate": dict(mesh="tp = 2", shard="tp { qkv = replicate }"),
    "tp-embedding-hidden": dict(mesh="tp = 2", shard="tp { embedding = hidden }"),
    "tp-proj-column": dict(mesh="tp = 2", shard="tp { proj = column }"),
    # the GEMMs' gathered inputs gathered again in the backward (Megatron-LM's), with a
    # split backward, recomputation of the attention's inputs, and ZeRO-3
    "tp-sp-regather": dict(
        mesh="tp = 2", m=2, shard="tp { sequence_parallel = on; gathered_inputs = regather }"),
    "tp-sp-regather-pp-zb1p-attention-inputs": dict(
        mesh="tp = 2; pp = 2", m=4, schedule="; pipeline = zb1p",
        optimize="recompute = attention_inputs",
        shard="tp { sequence_parallel = on; gathered_inputs = regather }"),
    "tp-sp-regather-zero3-selective": dict(
        mesh="tp = 2; dp = 2", m=2, optimize="recompute = selective",
        shard="tp { sequence_parallel = on; gathered_inputs = regather }; dp { zero = 3 }"),
    "tp-qkv-row-proj-row-sp": dict(mesh="tp = 2",
                                   shard="tp { qkv = row; proj = row; sequence_parallel = on }"),
    "cp-allgather": dict(mesh="cp = 2"),
    "cp-ring": dict(mesh="cp = 2", shard="cp { attention = ring; load_balance = on }"),
    "pp-gpipe-uneven": dict(mesh="pp = 2", shard="pp { stages = [0..2, 3..3] }", m=4,
                            schedule="; pipeline = gpipe"),
    "pp-1f1b-uneven": dict(mesh="pp = 2", shard="pp { stages = [0..0, 1..3] }", m=4),
    "pp-interleaved": dict(mesh="pp = 2", shard="pp { virtual = 2 }", m=4,
                           schedule="; pipeline = interleaved"),
    # Uneven interleaving: 4 layers in 6 chunks, the first of the embedding alone and the
    # last of the head alone (Llama 3's layout), with tp and sequence parallelism; chunks
    # of 1 and 2 layers written out; the same with a tied head.
    "pp-interleaved-uneven-auto-tp-sp": dict(mesh="pp = 2; tp = 2", m=4,
                                             shard="pp { virtual = 3 }; tp { sequence_parallel "
                                                   "= on }", schedule="; pipeline = interleaved"),
    "pp-interleaved-uneven-explicit": dict(mesh="pp = 2", m=2, schedule="; pipeline = interleaved",
                                           shard="pp { virtual = 2; stages = [0, 1..2, 3, head] }"),
    "tied-pp-interleaved-uneven": dict(mesh="pp = 2", m=2, model="; tie_embeddings = on",
                                       schedule="; pipeline = interleaved",
                                       shard="pp { virtual = 2; stages = [embedding, 0..1, 2, 3] }"),
    "dp-zero0": dict(mesh="dp = 2", m=2),
    "dp-zero1": dict(mesh="dp = 2", shard="dp { zero = 1 }", m=2),
    "dp-zero3": dict(mesh="dp = 2", shard="dp { zero = 3 }", m=2),
    "custom-order": dict(mesh="tp = 2; dp = 2; order = [dp, tp, cp, pp]"),
    "recompute-full": dict(mesh="tp = 2", m=2, optimize="recompute = full"),
    "tp2-pp2-dp2": dict(mesh="tp = 2; pp = 2; dp = 2", m=2,
                        shard="tp { sequence_parallel = on }; dp { zero = 1 }"),
    "tied-over-pp": dict(mesh="pp = 2", m=2, model="; tie_embeddings = on"),
    "dp-zero2-sp": dict(mesh="tp = 2; dp = 2", m=2,
                        shard="tp { sequence_parallel = on }; dp { zero = 2 }"),
    "dp-zero3-recompute": dict(mesh="dp = 2", shard="dp { zero = 3 }", m=2,
                               optimize="recompute = full"),
    "tied-zero3": dict(mesh="dp = 2", shard="dp { zero = 3 }", model="; tie_embeddings = on"),
    "tied-pp-zero1": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                          shard="dp { zero = 1 }"),
    # ZeRO-1 as DeepSpeed's BF16_Optimizer sums its gradients: the whole bucket
    # all-reduced, each replica keeping its shard of the sum
    "tied-pp-zero1-all-reduce": dict(mesh="pp = 2; dp = 2", m=2, model="; tie_embeddings = on",
                                     shard="dp { zero = 1; grad_reduce = all_reduce }"),
}


# The features of training beyond the layout, all at once in one run per layout (a run
# costs its launch, not its steps): a cosine schedule with a warm-up step
# (train.lr_schedule), the global gradient norm clipped at CLIP, far below the norm of
# every step, so that every step clips (train.grad_clip, against torch's
# clip_grad_norm_), and an evaluation of 2 batches after steps 2 and 4 (train.eval_every),
# over 4 steps. With the matrix's lr = 0.5 the lr of steps 0..3 is 0.25, 0.5, 0.3875,
# 0.1625 (planc.plan.lr_schedule). tests/test_llama.py and tests/test_moe.py run their
# families' rows of it, tests/test_checkpoint.py a resumed run.
CLIP = 0.05
FEATURE_STEPS = 4


def features(min_lr: str = "0.05", evaluate: bool = True) -> str:
    """The train block's entries of FEATURES, for a plan whose lr is above ``min_lr``;
    without the evaluations where ``evaluate`` is false."""
    return (f"; lr_schedule = cosine(warmup = 1, min_lr = {min_lr}); grad_clip = {CLIP}"
            + ("; eval_every = 2; eval_batches = 2" if evaluate else ""))


def featured(case: dict, more: str = "", evaluate: bool = True) -> dict:
    """A matrix row's case with FEATURES (and ``more`` train entries) over 4 steps."""
    return {**case, "steps": FEATURE_STEPS,
            "train": case.get("train", "") + features(evaluate=evaluate) + more}


def reference_norm(text: str, overrides: tuple[str, ...] = ()) -> float:
    """The single process's gradient norm of the first step (torch's own)."""
    import torch

    from planc.lang import load_text
    from planc.runtime.oracle import reference
    from planc.runtime.engine.data import DataSource, batch_tokens

    plan = load_text(text, "<plan>", overrides).plan
    params = {n: reference.initial(plan, n, p.shape).requires_grad_()
              for n, p in reference.parameters(plan).items()}
    total, _ = reference.objective(plan, params, batch_tokens(DataSource.of(plan), 0, None))
    total.backward()
    return float(torch.nn.utils.clip_grad_norm_(list(params.values()), float("inf")))


def check_features(records: list[dict], err: str, text: str, lr: float, min_lr: float,
                   overrides: tuple[str, ...] = (), evaluated: bool = True) -> None:
    """What a run of FEATURES must show beyond --check's verdict (which compares every
    loss, evaluation and parameter with the single process that schedules, clips and
    evaluates alike): 4 steps at the schedule's lr, every step clipped (the coefficient
    CLIP / (norm + 1e-6) below 1) from the single process's first norm, evaluations
    after steps 2 and 4, both compared (none where not ``evaluated``)."""
    from planc.plan.lr_schedule import LrSchedule, lr_at

    assert [r["step"] for r in records] == list(range(FEATURE_STEPS))
    cosine = LrSchedule("cosine", warmup=1, min_lr=min_lr)
    assert [r["lr"] for r in records] == [lr_at(cosine, lr, FEATURE_STEPS, k)
                                          for k in range(FEATURE_STEPS)]
    norms = [r["grad_norm"] for r in records]
    assert all(n > 10 * CLIP for n in norms), norms
    assert norms[0] == pytest.approx(reference_norm(text, overrides), rel=1e-5)
    assert [r["step"] for r in records if "eval_loss" in r] == ([1, 3] if evaluated else [])
    assert ("and 2 evaluations against the single-process run" in err) == evaluated, err


def plan_text(name: str, **case) -> str:
    values = dict(model="", mesh="", shard="", m=1, schedule="", optimize="", topology="",
                  steps=2, train="")
    values.update(case)
    return TEMPLATE.format(name=name.replace("-", "_"), **values)


def run(args: list[str], capfd) -> tuple[int, str]:
    """``planc run ARGS`` in this process; gloo unless ARGS name a backend (planc picks
    nccl on a machine with GPUs, which has fewer GPUs than most of these plans' ranks)."""
    args = [*map(str, args)]
    if "--backend" not in args:
        args += ["--backend", "gloo"]
    status = main(["run", *args])
    return status, capfd.readouterr().err


def run_checked(name: str, case: dict, tmp_path, capfd, *switches: str) -> list[dict]:
    """``planc run --check`` of the matrix plan ``name`` into tmp_path/build: it must match
    the one-process run; its metrics records."""
    return run_checked_with_output(name, case, tmp_path, capfd, *switches)[0]


def run_checked_with_output(name: str, case: dict, tmp_path, capfd, *switches: str
                            ) -> tuple[list[dict], str, str]:
    """As run_checked; with what the run wrote to stderr and the plan's text."""
    plan = tmp_path / f"{name}.plan"
    text = plan_text(name, **case)
    plan.write_text(text)
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--metrics", metrics,
                       "--timeout", "60", *switches], capfd)
    assert status == 0, err
    assert "every loss and parameter matches" in err
    return [json.loads(line) for line in metrics.read_text().splitlines()], err, text

"""The plans of planc run's --check matrix (tests/test_runtime.py) and how a test runs one:
``planc run`` in the test's own process, so that torch.distributed's launcher starts the
ranks from one fork server per worker process (torch is imported once). Shared by
tests/test_runtime.py, tests/test_runtime_comm.py and tests/test_runtime_data_and_failures.py.
"""

from __future__ import annotations

import json

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
}


# A cosine schedule with a warm-up step over 4 steps (train.lr_schedule): the lr of steps
# 0..3 is 0.25, 0.5, 0.3875, 0.1625 (planc.lr_schedule), under tp with sequence
# parallelism, pp with ZeRO 1, and with the samples of the project's corpus shuffled
# (train.shuffle; the test names the corpus and a vocab that holds its ids).
COSINE = "; lr_schedule = cosine(warmup = 1, min_lr = 0.05)"
SCHEDULED = {
    "cosine-tp-sp": dict(mesh="tp = 2", shard="tp { sequence_parallel = on }", steps=4,
                         train=COSINE),
    "cosine-pp2-dp2-zero1": dict(mesh="pp = 2; dp = 2", shard="dp { zero = 1 }", m=2, steps=4,
                                 train=COSINE),
    "cosine-shuffled-corpus-tp-dp": dict(mesh="tp = 2; dp = 2", m=2, steps=4,
                                         train=COSINE + "; shuffle = on"),
}


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
    plan = tmp_path / f"{name}.plan"
    plan.write_text(plan_text(name, **case))
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([plan, "-o", tmp_path / "build", "--check", "--metrics", metrics,
                       "--timeout", "60", *switches], capfd)
    assert status == 0, err
    assert "every loss and parameter matches" in err
    return [json.loads(line) for line in metrics.read_text().splitlines()]

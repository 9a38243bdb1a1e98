"""planc run's per-step metrics beyond the times (TFLOP/s per device, MFU, every rank's
peak memory, the plan's name), --tensorboard, planc plot and the loss curve of planc
report (docs/metrics.md). Runs are real: gloo processes, 4 ranks, 2 steps."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PLANS, ROOT, unprivileged

from planc.build.directory import plan_fingerprint
from planc.compile import compile_plan
from planc.lang import load_file, load_text
from planc.data.metrics_file import read_metrics
from planc.models import step_model_flops
from planc.simulate import simulate
from planc.views.curves import HEIGHT_IN, WIDTH_IN, DPI, Curve, curve, inline_svg

# gpt-tiny by hand (Narayanan et al. 2021, eq. 3): per token, 4 layers of
# 2 (4 h^2 + 2 h ffn) + 4 s h, and the head's 2 h V; times 3 (forward and backward) and
# the step's batch * seq = 16 * 32 tokens.
GPT_TINY_PER_TOKEN = 4 * (2 * (4 * 64 * 64 + 2 * 64 * 256) + 4 * 32 * 64) + 2 * 64 * 256
GPT_TINY_STEP_FLOPS = 3 * 16 * 32 * GPT_TINY_PER_TOKEN
FOUR_RANKS = ("--set", "mesh.dp=1", "--set", "topology.nodes=1",  # tp 2 x pp 2
              "--set", "shard.dp.zero=0")


def planc(*args, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_the_build_records_the_model_flops_of_a_step(tmp_path):
    plan = load_file(PLANS / "gpt-tiny.plan").plan
    assert step_model_flops(plan) == GPT_TINY_STEP_FLOPS == 704_643_072
    assert simulate(compile_plan(plan)).model_flops == GPT_TINY_STEP_FLOPS
    done = planc("compile", PLANS / "gpt-tiny.plan", "-o", tmp_path / "b")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "b" / "build.json").read_text())
    assert manifest["version"] == 4
    assert manifest["mfu"] == {"model_flops_per_step": 704_643_072.0,
                               "peak_flops_per_device": 989e12}
    # recomputation is hardware FLOPs, not model FLOPs: the same count with it on
    recomputed = load_file(PLANS / "gpt-tiny.plan", ("optimize.recompute=full",)).plan
    assert step_model_flops(recomputed) == GPT_TINY_STEP_FLOPS


def test_a_build_without_its_step_flops_is_refused_by_a_rank(tmp_path):
    assert planc("compile", PLANS / "gpt-tiny.plan", "-o", tmp_path / "b").returncode == 0
    manifest_path = tmp_path / "b" / "build.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["mfu"]["peak_flops_per_device"] = 0
    manifest_path.write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-c", "from planc.build.files import read_for_run;"
                           f"read_for_run({str(tmp_path / 'b')!r})"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"planc.build.files.BuildError: {manifest_path} has no valid mfu section (the model "
        f"FLOPs of a step and the peak FLOP/s of a device, numbers from 1 to 1e+30); run "
        f"planc compile again")


NO_MACHINE = """plan x {
  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 64; seq = 8; batch = 2 }
  train { steps = 2; optimizer = sgd(lr = 0.1) }
}
"""


def test_a_plan_that_names_no_machine_reports_no_mfu(tmp_path):
    """No topology: the compiler prices the plan on a generic machine whose 100 TFLOP/s
    are no device's (an H200 once reported 'MFU 153%' against it), so there is no peak to
    divide by; a peak the plan writes is one."""
    (tmp_path / "x.plan").write_text(NO_MACHINE)
    done = planc("run", tmp_path / "x.plan", "-o", tmp_path / "b", "--metrics",
                 tmp_path / "m.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "b" / "build.json").read_text())
    assert manifest["mfu"]["peak_flops_per_device"] is None
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [("mfu" in r, r["tflops_per_device"] > 0) for r in records] == [(False, True)] * 2
    line = next(text for text in done.stderr.splitlines() if "step 2/2" in text)
    assert line.endswith(" TFLOP/s per device") and "MFU" not in line
    written = load_file(PLANS / "gpt-tiny.plan").plan.topology.device
    assert written.peak_known
    assert not load_text(NO_MACHINE).plan.topology.device.peak_known
    flops_written = NO_MACHINE.replace("train {", "topology { device { flops = 5TFLOP/s } }\n"
                                                  "  train {")
    assert load_text(flops_written).plan.topology.device.peak_known


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """gpt-tiny on 4 ranks for 2 steps, evaluating after the second, with --metrics and
    --tensorboard."""
    work = tmp_path_factory.mktemp("run")
    done = planc("run", PLANS / "gpt-tiny.plan", *FOUR_RANKS, "--set", "train.eval_every=2",
                 "--set", "train.eval_batches=1", "-o", work / "b", "--steps", 2,
                 "--metrics", work / "m.jsonl", "--tensorboard", work / "tb")
    assert done.returncode == 0, done.stderr[-3000:]
    return work, done


def test_every_step_reports_tflops_mfu_and_every_ranks_peak_memory(run):
    work, done = run
    records = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        # the slowest rank's streams: tp 2 x pp 2 transfers (a received gradient goes to
        # a tp all-reduce first: waiting for it counts as exposed, tests/test_runtime.py)
        assert 0 < record["compute_s"] <= record["time_s"]
        assert record["comm_s"] > 0 and record["exposed_comm_s"] > 0
        assert record["pipeline_wait_s"] >= 0 and record["slowest_rank"] in range(4)
        per_device = GPT_TINY_STEP_FLOPS / record["time_s"] / 4  # the slowest rank's step
        assert record["tflops_per_device"] == per_device / 1e12
        assert record["mfu"] == per_device / 989e12
        assert record["plan"] == "gpt_tiny"
        assert record["peak_memory"] == "max_rss"
        assert len(record["peak_memory_mb"]) == 4
        assert all(50 < mb < 4096 for mb in record["peak_memory_mb"])  # a torch process
        assert record["max_rss_mb"] == max(record["peak_memory_mb"])
        assert isinstance(record["page_faults"], int) and record["page_faults"] >= 0
        # the keys of before, unchanged
        assert record["tokens_per_s"] == 16 * 32 / record["time_s"]
        assert record["build"] == json.loads((work / "b" / "build.json").read_text())[
            "plan_sha256"]
    assert records[0]["page_faults"] > 1000  # the first step faults in what it grows into
    line = next(text for text in done.stderr.splitlines() if "step 2/2" in text)
    assert f"{records[1]['tflops_per_device']:.3g} TFLOP/s per device  MFU " \
           f"{100 * records[1]['mfu']:.2g}%" in line


# bench/peers.py's model, whose activations are 1-8 MiB: enough for glibc to hand a
# thread's arena back to the kernel between steps if it is not told to keep it.
PEERS_DP2 = """plan bench {
  model gpt { layers = 4; hidden = 256; heads = 8; vocab = 2048; seq = 128; batch = 16 }
  mesh { dp = 2 }
  topology { preset = cpu }
  train { steps = 12; optimizer = adamw(lr = 1e-3); seed = 1 }
}
"""


def test_a_trained_step_takes_few_page_faults_once_the_heap_has_grown(tmp_path):
    """Every rank's threads allocate from one glibc arena that keeps what a step frees
    (planc.runtime.engine.host_memory). A thread that allocated before the rank said so
    (the launcher's watch) had got an arena of its own, the stream threads shared it, and
    glibc unmapped its 64 MiB heaps whenever they emptied: 4,400 to 7,200 minor faults in
    every step of this plan (17 to 28 MiB touched afresh)."""
    (tmp_path / "dp2.plan").write_text(PEERS_DP2)
    done = planc("run", tmp_path / "dp2.plan", "-o", tmp_path / "b", "--metrics",
                 tmp_path / "m.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    faults = [r["page_faults"] for r in read_metrics(tmp_path / "m.jsonl").records]
    assert len(faults) == 12
    # Before, every step faulted at least 4,400 times. Now a late step can take fewer than
    # one 4 MiB activation's pages (1,024); others still fault a few hundred to 2,000 times
    # (multiples of 256: CPython's 1 MiB object arenas, unmapped once empty; more on a busy
    # machine, where a median of 1,033 was seen), so: one of the last six under 1,536 (six
    # arenas), and their median under half the old least.
    late = sorted(faults[-6:])
    assert late[0] < 1536, faults
    assert (late[2] + late[3]) / 2 < 2200, faults


def test_tensorboard_scalars_equal_the_metrics_file(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from planc.runtime.step_metrics import TENSORBOARD_SCALARS

    work, _ = run
    records = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert len(list((work / "tb").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(work / "tb"))
    events.Reload()
    expected = {key: [(r["step"] + 1, r[key]) for r in records if key in r]
                for key in TENSORBOARD_SCALARS if any(key in r for r in records)}
    assert {"loss", "tokens_per_s", "tflops_per_device", "mfu", "exposed_comm_s",
            "time_s", "eval_loss", "eval_s"} <= set(expected)
    assert [step for step, _ in expected["eval_loss"]] == [2]  # the steps that evaluated
    assert [step for step, _ in expected["eval_s"]] == [2]
    assert sorted(events.Tags()["tensors"]) == sorted(expected)
    for key, values in expected.items():
        read = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item())
                for e in events.Tensors(key)]
        assert read == values, key  # float64: exactly the file's numbers


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "tb").write_text("x"), "--tensorboard {d}/tb: is not a directory"),
    (lambda d: (d / "file").write_text("x"),
     "--tensorboard {d}/file/tb: cannot be created ({d}/file is not a directory)"),
])
def test_a_tensorboard_directory_that_cannot_be_written_stops_the_run_first(
        tmp_path, make, message):
    make(tmp_path)
    target = tmp_path / ("tb" if (tmp_path / "tb").exists() else "file/tb")
    done = planc("run", PLANS / "gpt-tiny.plan", *FOUR_RANKS, "-o", tmp_path / "b",
                 "--metrics", tmp_path / "m.jsonl", "--tensorboard", target)
    assert done.returncode == (2 if target.name == "tb" and target.parent == tmp_path else 1)
    assert done.stderr == f"planc: error: {message.format(d=tmp_path)}\n"
    assert not (tmp_path / "b").exists() and not (tmp_path / "m.jsonl").exists()


def test_an_unwritable_tensorboard_directory_stops_the_run_first(tmp_path,
                                                                  permissions_apply):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        done = unprivileged([sys.executable, "-m", "planc", "run",
                             str(PLANS / "gpt-tiny.plan"), *FOUR_RANKS, "-o",
                             str(tmp_path / "b"), "--tensorboard", str(locked)])
    finally:
        locked.chmod(0o755)
    assert done.returncode == 1
    assert done.stderr == (f"planc: error: --tensorboard {locked}: cannot write there "
                           f"({locked}: permission denied)\n")
    assert not (tmp_path / "b").exists() and os.listdir(locked) == []


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a GPU")
def test_peak_memory_on_a_gpu_is_what_torch_allocated():
    import torch

    from planc.runtime.step_metrics import peak_memory_mb

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the allocator's statistics exist once it has been used
    torch.cuda.reset_peak_memory_stats(device)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    measured, kind = peak_memory_mb(device)
    assert kind == "cuda_max_allocated"
    assert measured == torch.cuda.max_memory_allocated(device) / 2**20 >= 64
    del block


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(plan: str, losses: list[float]) -> list[dict]:
    return [{"step": k, "loss": loss, "time_s": 0.5, "exposed_comm_s": 0.1,
             "tokens_per_s": 1024.0, "plan": plan, "build": "f" * 64}
            for k, loss in enumerate(losses)]


def test_plot_draws_each_runs_loss_with_its_plan_name(run, tmp_path):
    work, _ = run
    other = _write(tmp_path / "other.jsonl", _records("llama_tiny", [6.5, 6.25, 6.0]))
    done = planc("plot", work / "m.jsonl", other, "-o", tmp_path / "loss.png")
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"planc: loss of 2 runs written to {tmp_path / 'loss.png'}\n"
    assert _png_size(tmp_path / "loss.png") == (WIDTH_IN * DPI, HEIGHT_IN * DPI) == (800, 450)
    records = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert curve(read_metrics(str(work / "m.jsonl"))[0], "loss", "m.jsonl") == Curve(
        "gpt_tiny", (1, 2), tuple(r["loss"] for r in records))
    assert curve(read_metrics(str(other))[0], "loss", str(other)) == Curve(
        "llama_tiny", (1, 2, 3), (6.5, 6.25, 6.0))
    # the same image again, byte for byte (no dates, no versions in it)
    again = planc("plot", work / "m.jsonl", other, "-o", tmp_path / "again.png")
    assert again.returncode == 0
    assert (tmp_path / "again.png").read_bytes() == (tmp_path / "loss.png").read_bytes()


def test_plot_tells_two_runs_of_one_plan_apart_by_file_and_draws_other_metrics(tmp_path):
    from planc.views.curves import distinct

    a = _write(tmp_path / "a.jsonl", _records("p", [2.0, 1.0]))
    b = _write(tmp_path / "b.jsonl", _records("p", [2.0, 1.5]))
    curves = [curve(read_metrics(str(f))[0], "tokens_per_s", str(f)) for f in (a, b)]
    assert distinct(curves, [str(a), str(b)]) == [
        Curve("p (a.jsonl)", (1, 2), (1024.0, 1024.0)),
        Curve("p (b.jsonl)", (1, 2), (1024.0, 1024.0))]
    done = planc("plot", a, b, "-o", tmp_path / "t.svg", "--metric", "tokens_per_s")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


def test_plot_does_not_import_torch(tmp_path):
    metrics = _write(tmp_path / "m.jsonl", _records("p", [1.0]))
    code = ("import sys; from planc.cli import main; "
            f"status = main(['plot', {str(metrics)!r}, '-o', {str(tmp_path / 'p.png')!r}]); "
            "sys.exit(status or ('torch' in sys.modules) * 7)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("content, output, message", [
    (None, "p.png", "cannot read {d}/m.jsonl: No such file or directory"),
    ("", "p.png", "{d}/m.jsonl is not a planc run metrics file (no step records)"),
    ("not json\n", "p.png",
     "{d}/m.jsonl is not a planc run metrics file (one JSON object per line)"),
    ('{"step": 0, "time_s": 1.0}\n', "p.png", "{d}/m.jsonl: the record of step 1 has no loss"),
    ('{"time_s": 1.0, "loss": 2.0}\n', "p.png",
     "{d}/m.jsonl: line 1 has no step number (a whole number from 0 to 10^12); it is not "
     "what planc run --metrics writes"),
    ('{"step": 0, "time_s": 1.0, "loss": 2.0}\n', "p.jpg",
     "-o {d}/p.jpg: planc plot writes a .png or an .svg file; name one"),
    ('{"step": 0, "time_s": 1.0, "loss": 2.0}\n', "dir.png",
     "-o {d}/dir.png: is a directory; name a file"),
    ('{"step": 0, "time_s": 1.0, "loss": 2.0}\n', "missing/p.png",
     "-o {d}/missing/p.png: cannot write there ({d}/missing does not exist)"),
])
def test_plot_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, content, output,
                                                                message):
    if content is not None:
        (tmp_path / "m.jsonl").write_text(content)
    (tmp_path / "dir.png").mkdir()
    before = sorted(os.listdir(tmp_path))
    done = planc("plot", tmp_path / "m.jsonl", "-o", tmp_path / output)
    assert done.returncode == (2 if output in ("p.jpg", "dir.png") else 1)
    assert done.stderr == f"planc: error: {message.format(d=tmp_path)}\n"
    assert sorted(os.listdir(tmp_path)) == before


def test_the_report_embeds_the_measured_loss_curve(run, tmp_path):
    work, _ = run
    page_path = tmp_path / "report.html"
    done = planc("report", work / "b", "-o", page_path, "--metrics", work / "m.jsonl")
    assert done.returncode == 0, done.stderr
    page = page_path.read_text()
    records = read_metrics(str(work / "m.jsonl"))[0]
    section = ('<h2>Loss per step (measured)</h2>\n<div class="curve">'
               + inline_svg([curve(records, "loss", "gpt_tiny")], "loss") + "</div>")
    assert section in page
    assert page.count("<h2>Loss per step (measured)</h2>") == 1
    overrides = ("mesh.dp=1", "topology.nodes=1", "shard.dp.zero=0", "train.eval_every=2",
                 "train.eval_batches=1")
    plan = load_file(PLANS / "gpt-tiny.plan", overrides).plan
    assert records[0]["build"] == plan_fingerprint(plan)


def test_without_the_tensorboard_package_the_run_stops_first(tmp_path):
    # tensorboard made unimportable in the process that runs planc (None in sys.modules)
    code = ("import sys; sys.modules['tensorboard'] = None; from planc.cli import main; "
            f"sys.exit(main(['run', {str(PLANS / 'gpt-tiny.plan')!r}, *{FOUR_RANKS!r}, "
            f"'-o', {str(tmp_path / 'b')!r}, '--tensorboard', {str(tmp_path / 'tb')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr == ("planc: error: --tensorboard needs the tensorboard package, which "
                           "is not installed: pip install 'planc[run]'\n")
    assert os.listdir(tmp_path) == []


def test_the_report_draws_no_loss_curve_for_metrics_without_losses(run, tmp_path):
    work, _ = run
    records = read_metrics(str(work / "m.jsonl"))[0]
    lossless = _write(tmp_path / "m.jsonl", [{k: v for k, v in r.items() if k != "loss"}
                                             for r in records])
    done = planc("report", work / "b", "-o", tmp_path / "r.html", "--metrics", lossless)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Predicted and measured</h2>" in page and "Loss per step" not in page


def test_plot_draws_a_metric_at_the_steps_that_have_it_and_refuses_one_no_step_has(tmp_path):
    records = _records("p", [3.0, 2.0, 1.0])
    records[1]["eval_loss"] = 2.5
    records[2]["eval_loss"] = 1.5
    metrics = _write(tmp_path / "m.jsonl", records)
    assert curve(read_metrics(str(metrics))[0], "eval_loss", str(metrics)) == Curve(
        "p", (2, 3), (2.5, 1.5))
    done = planc("plot", metrics, "-o", tmp_path / "e.png", "--metric", "eval_loss")
    assert done.returncode == 0, done.stderr
    done = planc("plot", metrics, "-o", tmp_path / "lr.png", "--metric", "lr")
    assert done.returncode == 1
    assert done.stderr == (f"planc: error: {metrics}: no step has lr: the run did not record "
                           f"it (planc plot --metric lr needs a run that did)\n")
    assert not (tmp_path / "lr.png").exists()


def _without_matplotlib(argv: list[str]):
    """planc in a process where matplotlib cannot be imported (None in sys.modules)."""
    code = ("import sys; sys.modules['matplotlib'] = None; from planc.cli import main; "
            f"sys.exit(main({[str(a) for a in argv]!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)


def test_without_matplotlib_plot_says_so_and_the_report_notes_it(run, tmp_path):
    work, _ = run
    done = _without_matplotlib(["plot", work / "m.jsonl", "-o", tmp_path / "p.png"])
    assert done.returncode == 1
    assert done.stderr == ("planc: error: planc plot needs matplotlib, which is not "
                           "installed: pip install 'planc[run]'\n")
    assert os.listdir(tmp_path) == []
    done = _without_matplotlib(["report", work / "b", "-o", tmp_path / "r.html",
                                "--metrics", work / "m.jsonl"])
    assert done.returncode == 0, done.stderr
    assert ('<h2>Loss per step (measured)</h2>\n<div class="curve"><p class="note">The loss '
            'curve needs matplotlib: <code>pip install &#x27;planc[run]&#x27;</code>.</p>'
            '</div>') in (tmp_path / "r.html").read_text()


def test_transfers_the_compute_stream_runs_itself_are_all_exposed(tmp_path):
    """optimize { overlap = off } puts tp's collectives on the compute stream: their whole
    time is communication the step waits for, so exposed_comm_s is at least comm_s less
    what the rank's own loss all-reduce adds (docs/metrics.md)."""
    plan = tmp_path / "tp.plan"
    plan.write_text("plan tp {\n  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 128; "
                    "seq = 32; batch = 4 }\n  mesh { tp = 2 }\n  optimize { overlap = off }\n"
                    "  train { steps = 3; optimizer = sgd(lr = 0.1) }\n}\n")
    done = planc("run", plan, "-o", tmp_path / "b", "--metrics", tmp_path / "m.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(r["comm_s"] > 0 and r["exposed_comm_s"] >= 0.99 * r["comm_s"]
               for r in records), records

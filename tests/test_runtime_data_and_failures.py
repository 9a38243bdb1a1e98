"""planc run beyond the --check matrix (tests/test_runtime.py): a trace, the demo plan
on its corpus, token files (read a step at a time, checked, refused once changed), and
failures: a rank that raises, a transfer that never completes, two torchrun nodes, the
CUDA backend without GPUs, a wrong result, bf16 without parameter checks, an unwritable
output path."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planc.cli import main  # noqa: E402
from tests.conftest import PLANS, ROOT, free_port  # noqa: E402
from tests.runtime_matrix import MATRIX, plan_text, run  # noqa: E402

pytestmark = pytest.mark.slow


def test_gpt_tiny_with_adamw_and_a_trace(tmp_path, capfd):
    trace = tmp_path / "trace.json"
    status, err = run([PLANS / "gpt-tiny.plan", "-o", tmp_path / "b", "--steps", "2",
                       "--check", "--trace", trace], capfd)
    assert status == 0, err
    assert "step 2/2" in err and "every loss and parameter matches" in err
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"] for e in events if e["ph"] == "X"}
    assert processes == set(range(8))
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "comm", "send_next", "recv_next", "recv_prev", "send_prev"} <= names
    kinds = {e["name"].split(":")[-1] for e in events if e["ph"] == "X" and ":" in e["name"]}
    assert {"all_reduce@tp", "send@pp", "recv@pp", "reduce_scatter@dp_cp",
            "all_gather@dp_cp"} <= kinds
    # A flow arrow from every pipeline send to its receive on the peer rank: 2 steps x 4
    # microbatches x 2 directions on each of the 4 pipeline pairs.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == 2 * 4 * 2 * 4 and set(starts) == set(finishes)
    assert all(starts[i]["pid"] != finishes[i]["pid"] for i in starts)


def test_the_demo_plan_learns_the_corpus_exactly_like_one_process(tmp_path, capfd):
    """make demo's run, 16 of its 40 steps: plans/demo.plan on the corpus of make corpus.
    Uniform random tokens (the synthetic data) keep the loss at ln(vocab) whatever the
    model learns; the stories have structure, so the loss falls by more than 1.5."""
    from planc.data.corpus import main as make_corpus

    corpus = tmp_path / "tiny-corpus.tokens"
    assert make_corpus(["-o", str(corpus)]) == 0
    metrics = tmp_path / "metrics.jsonl"
    status, err = run([PLANS / "demo.plan", "-o", tmp_path / "b", "--set",
                       f'train.data="{corpus}"', "--steps", "16", "--check",
                       "--metrics", metrics, "--timeout", "60"], capfd)
    assert status == 0, err
    assert "check: 16 steps and 53 parameters on each of 2 replicas against the " \
           "single-process run (relative tolerance 1e-05): every loss and parameter " \
           "matches" in err
    loss = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(loss) == 16
    assert loss[0] == pytest.approx(math.log(1024), abs=0.05)  # an untrained model
    assert loss[-1] < loss[0] - 1.5


def test_data_from_a_file_of_uint16_tokens(tmp_path, capfd):
    tokens = torch.randint(0, 128, (1000,), generator=torch.Generator().manual_seed(1))
    (tmp_path / "tokens.bin").write_bytes(b"".join(int(t).to_bytes(2, "little")
                                                   for t in tokens))
    text = plan_text("file_data", mesh="tp = 2").replace(
        "seed = 3 }", 'seed = 3; data = "tokens.bin" }')
    (tmp_path / "f.plan").write_text(text)
    status, err = run([tmp_path / "f.plan", "-o", tmp_path / "b", "--check"], capfd)
    assert status == 0, err


def test_a_data_file_that_changed_after_compile_is_refused_before_any_rank_starts(
        tmp_path, capfd):
    text = plan_text("file_data").replace("seed = 3 }", 'seed = 3; data = "tokens.bin" }')
    (tmp_path / "f.plan").write_text(text)
    assert main(["compile", str(tmp_path / "f.plan"), "-o", str(tmp_path / "b")]) == 0
    assert "data file 'tokens.bin' does not exist (yet)" in capfd.readouterr().err
    tokens = tmp_path / "tokens.bin"
    status, err = run([tmp_path / "b"], capfd)
    assert (status, err) == (1, f"planc: error: data file {tokens} does not exist; nothing "
                                f"was run\n")
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in [5] * 40 + [300] + [5] * 9))
    status, err = run([tmp_path / "b"], capfd)
    assert (status, err) == (1, f"planc: error: data file {tokens} holds token id 300 (token "
                                f"40 of the file), not below vocab = 128; nothing was run\n")
    assert not (tmp_path / "b" / "logs").exists()


def test_run_of_a_plan_file_whose_data_is_missing_writes_no_build(tmp_path, capfd):
    """A bad input changes nothing: the token file is looked at before the plan is
    compiled (it compiled, wrote the build directory, then refused)."""
    text = plan_text("file_data").replace("seed = 3 }", 'seed = 3; data = "tokens.bin" }')
    (tmp_path / "f.plan").write_text(text)
    status, err = run([tmp_path / "f.plan", "-o", tmp_path / "b"], capfd)
    assert (status, err.splitlines()[-1]) == (1, f"planc: error: data file "
                                                 f"{tmp_path / 'tokens.bin'} does not exist; "
                                                 f"nothing was run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.plan"]
    # and an evaluation's own file, which a run read first after eval_every steps
    (tmp_path / "f.plan").write_text(plan_text("file_data").replace(
        "seed = 3 }", 'seed = 3; eval_every = 2; eval_data = "held-out.bin" }'))
    status, err = run([tmp_path / "f.plan", "-o", tmp_path / "b"], capfd)
    assert (status, err.splitlines()[-1]) == (1, f"planc: error: data file "
                                                 f"{tmp_path / 'held-out.bin'} does not "
                                                 f"exist; nothing was run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.plan"]


def test_a_data_file_is_read_a_step_at_a_time_and_each_batch_checked(tmp_path):
    from planc.lang import load_text
    from planc.runtime.engine.data import DataError, batch_tokens

    tokens = tmp_path / "tokens.bin"
    values = list(range(100))
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in values))
    text = plan_text("file_data").replace("seed = 3 }", f'seed = 3; data = "{tokens}" }}')
    plan = load_text(text).plan
    values[86] = 500  # written after the check: beyond vocab, and only in step 1's batch
    tokens.write_bytes(b"".join(t.to_bytes(2, "little") for t in values))
    first = batch_tokens(plan, 0)
    assert first.shape == (8, 17) and first.dtype == torch.int64
    # 100 tokens hold 84 sample starts: sample j starts at token (17 j) mod 84
    assert [int(row[0]) for row in first] == [17 * j % 84 for j in range(8)]
    assert first[5].tolist() == list(range(1, 18))
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 1)
    assert str(caught.value) == (f"data file {tokens} holds token id 500 (token 86 of the "
                                 f"file, position 16 of sample 14, read by step 1), not "
                                 f"below vocab = 128")
    tokens.write_bytes(b"\x01\x00" * 10)
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 0)
    assert str(caught.value) == (f"data file {tokens} no longer holds one sample (seq + 1 = "
                                 f"17 tokens)")
    tokens.unlink()
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 0)
    assert str(caught.value) == (f"data file {tokens} cannot be read for step 0 (No such "
                                 f"file or directory)")


# --- failures ---------------------------------------------------------------------------------


def _compiled(tmp_path, name: str, capfd) -> Path:
    plan = tmp_path / f"{name}.plan"
    plan.write_text(plan_text(name, **MATRIX[name]))
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    return tmp_path / "b"


def _edit(directory: Path, name: str, change) -> None:
    path = directory / "programs" / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_rank_that_raises_brings_the_run_down_with_its_traceback(tmp_path, capfd):
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)

    def misorder(data):  # stage 1 runs a backward step before its input gradient exists
        block = data["blocks"]["B1"]
        steps = [i for i, x in enumerate(block) if x["op"] == "compute"]
        block[steps[0]], block[steps[3]] = block[steps[3]], block[steps[0]]

    _edit(build, "stage1.json", misorder)
    status, err = run([build, "--no-verify", "--timeout", "60"], capfd)
    assert status == 1
    assert "planc: rank 1 exited with status 1" in err
    assert "planc: traceback of rank 1, the first to fail:" in err
    # once, after the launcher's lines (rank 1 keeps it in its log directory's error.txt),
    # and rank 0's report of the peer it lost left out for one line
    assert err.count("KeyError: ('B/final_ln', 0)") == 1 and "[rank 1] Traceback" not in err
    assert "lost a peer" not in err
    assert "planc: rank 0 was stopped because rank 1 failed" in err


def test_a_bad_batch_read_by_several_ranks_is_reported_once(tmp_path):
    """Token ids beyond the vocabulary written into the data file while the run trains
    (its identity kept): both tensor-parallel ranks read the same batch and stop on the
    same error, which the console shows once, the ranks each named once after it."""
    from tests.launched import kill_all, start, wait_for_training

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"".join((t % 128).to_bytes(2, "little") for t in range(4000)))
    (tmp_path / "f.plan").write_text(plan_text("bad_batch", mesh="tp = 2").replace(
        "seed = 3 }", f'seed = 3; data = "{tokens}" }}'))
    assert main(["compile", str(tmp_path / "f.plan"), "-o", str(tmp_path / "b")]) == 0
    process = start(tmp_path / "b", "--steps", "100000", "--timeout", "60")
    try:
        wait_for_training(process, 2)
        before = tokens.stat()
        with open(tokens, "r+b") as handle:
            handle.write((300).to_bytes(2, "little") * 4000)
        os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
        _, err = process.communicate(timeout=120)
    finally:
        kill_all(process)
    assert process.returncode == 1
    assert "lost a peer" not in err and "Traceback" not in err
    progress = re.compile(r"\[rank \d\] \[[#-]+\] step ")
    lines = [line for line in err.splitlines() if not progress.match(line)]
    assert lines[0].startswith("planc: running bad_batch"), err
    # the cause once, from the rank whose line came first
    assert re.fullmatch(rf"\[rank [01]\] planc: error: data file {tokens} holds token id "
                        rf"300 \(.*\), not below vocab = 128", lines[1]), err
    shown = int(lines[1][6])
    other = 1 - shown
    same = f"with the same error as rank {shown} (above)"
    # each rank named once, however the two stops interleaved: the other one exited or
    # was stopped after printing the same error, or was stopped before it read the batch
    assert len(lines) == 4 and {lines[2], lines[3]} in [{a, b} for a in (
        f"planc: rank {shown} exited with status 1",
        f"planc: rank {shown} failed with the error above") for b in (
        f"planc: rank {other} exited with status 1, {same}",
        f"planc: rank {other} failed {same}",
        f"planc: rank {other} was stopped because rank {shown} failed")], err


def test_an_instruction_without_its_kernel_stops_an_unverified_run_in_one_line(
        tmp_path, capfd):
    """A damaged build (a compute instruction whose kernel was taken out) run with
    --no-verify: each rank stops while binding its program, the instruction named, never
    a traceback; planc verify refuses the same build."""
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)
    taken = []

    def drop_kernel(data):
        for block in data["blocks"].values():
            for item in block:
                if item["op"] == "compute" and "kernel" in item.get("operands", {}):
                    taken.append(item["node"])
                    del item["operands"]["kernel"]
                    return

    _edit(build, "stage0.json", drop_kernel)
    assert main(["verify", str(build)]) == 1
    capfd.readouterr()
    status, err = run([build, "--no-verify", "--timeout", "60"], capfd)
    assert status == 1
    assert "Traceback" not in err and "traceback" not in err
    assert f"[rank 0] planc: error: rank 0: its program's compute {taken[0]} on stream " \
           f"compute cannot be run: None is not a valid Op (planc verify {build} says " \
           f"what is wrong with the build)\n" in err


def test_an_instruction_that_cannot_be_bound_on_a_verified_run_is_planc_s_own_error(
        tmp_path, capfd):
    """The same damage where the ranks are told the programs were verified (RunOptions
    without unverified: what planc run starts after planc verify passed): a failure to
    bind is then planc's fault, not the build's, and its traceback is shown, where the
    one line pointed at planc verify, which would find nothing."""
    from planc.runtime.launcher.launch import launch
    from planc.runtime.options import RunOptions

    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)

    def drop_kernel(data):
        for block in data["blocks"].values():
            for item in block:
                if item["op"] == "compute" and "kernel" in item.get("operands", {}):
                    del item["operands"]["kernel"]
                    return

    _edit(build, "stage0.json", drop_kernel)
    capfd.readouterr()
    assert launch(RunOptions(str(build), backend="gloo", timeout=60), 2) == 1
    err = capfd.readouterr().err
    assert "planc: traceback of rank 0, the first to fail:" in err
    assert "ValueError: None is not a valid Op" in err and "says what is wrong" not in err


def test_a_send_to_a_stage_that_does_not_exist_is_named_as_the_build_writes_it(
        tmp_path, capfd):
    """A lookup that fails while binding (a KeyError) names what the program asked for
    as its files write it, not as Python's repr of a tuple of enums."""
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)
    sent = []

    def send_far(data):
        for block in data["blocks"].values():
            for item in block:
                if item["op"] == "send":
                    sent.append(item["node"])
                    item["operands"]["peer_stage"] = 7
                    return

    _edit(build, "stage0.json", send_far)
    status, err = run([build, "--no-verify", "--timeout", "60"], capfd)
    assert status == 1
    assert "Traceback" not in err and "traceback" not in err
    assert f"[rank 0] planc: error: rank 0: its program's send {sent[0]} on stream " \
           f"send_next cannot be run: it names pp:forward:0>7, which its program does " \
           f"not hold (planc verify {build} says what is wrong with the build)\n" in err


def test_a_transfer_that_never_completes_makes_every_rank_report(tmp_path, capfd):
    build = _compiled(tmp_path, "pp-1f1b-uneven", capfd)
    _edit(build, "stage0.json", lambda data: data["blocks"].update(
        F0=[x for x in data["blocks"]["F0"] if x["op"] != "send"]))
    assert main(["verify", str(build)]) == 1  # the verifier would have refused it
    capfd.readouterr()
    # 5 s: the start-up watch has the same timeout, and a rank that joins the world 3 s
    # after the other on a busy machine would be reported stuck while joining
    status, err = run([build, "--no-verify", "--timeout", "5"], capfd)
    assert status == 1
    # The run ended on the watchdog's event at the 5 s given, not on a clock of this test
    # (which a busy machine's start-up of torch could pass): its report says so.
    assert "rank 1 (stage 1, tp 0, cp 0, dp 0) made no progress for 5 s in step 0; its " \
           "streams wait on:" in err
    assert "  recv_prev: #0 recv F/c0>c1:recv@pp (microbatch 0): receive from rank 0 (pp)" in err
    assert "rank 0 (stage 0, tp 0, cp 0, dp 0)" in err
    assert "recv_next: #" in err and "receive from rank 1 (pp)" in err


# --- a cluster launch -----------------------------------------------------------------------


def test_two_torchrun_nodes_on_localhost_form_one_world(tmp_path, capfd):
    plan = tmp_path / "four.plan"
    plan.write_text(plan_text("four", mesh="tp = 2; pp = 2", m=2))
    assert main(["compile", str(plan), "-o", str(tmp_path / "four")]) == 0
    capfd.readouterr()
    port = str(free_port())
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(i), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "planc.runtime.worker", str(tmp_path / "four"), "--check"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "every loss and parameter matches" in outputs[0][1]


# --- GPUs -------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_nccl_with_cuda_streams(tmp_path, capfd):  # pragma: no cover - no GPU here
    plan = tmp_path / "cuda.plan"
    plan.write_text(plan_text("cuda", mesh="tp = 2", m=2))
    status, err = run([plan, "-o", tmp_path / "b", "--check", "--backend", "nccl"], capfd)
    assert status == 0, err


def test_cuda_backend_refused_cleanly_without_gpus(tmp_path, capfd):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    plan = tmp_path / "p.plan"
    plan.write_text(plan_text("p", mesh="tp = 2"))
    status, err = run([plan, "-o", tmp_path / "b", "--backend", "nccl"], capfd)
    assert status == 1  # this machine cannot do it (README, "Exit status")
    assert "the nccl backend needs a GPU per rank" in err
    shutil.rmtree(tmp_path / "b")


def test_check_reports_a_wrong_result_per_parameter(tmp_path, capfd):
    build = _compiled(tmp_path, "tp-megatron", capfd)
    # the program is what runs: a sum that became a max, wrong numbers and no crash (the
    # verifier refuses operands the graph does not imply, and the graph must be the
    # plan's: run unverified, as --no-verify allows)
    program = json.loads((build / "programs" / "stage0.json").read_text())
    for block in program["blocks"].values():
        for instruction in block:
            if instruction.get("node") == "F/L1/fc2>mlp_residual:all_reduce@tp":
                instruction["operands"]["reduce_op"] = "max"
    (build / "programs" / "stage0.json").write_text(json.dumps(program))
    status, err = run([build, "--check", "--no-verify"], capfd)
    assert status == 1
    assert "against the single-process run (relative tolerance 1e-05): FAILED" in err
    # the forward differs from the first step on: both losses, and the parameters
    lines = [line.removeprefix("[rank 0] ") for line in err.splitlines()]
    for step in (0, 1):
        line = next(line for line in lines if line.startswith(f"  step {step}: loss "))
        assert ", single process " in line and line.endswith("  MISMATCH"), line
    assert any(line.startswith("  layers.1.fc2.weight: largest difference ") and
               line.endswith("  MISMATCH") for line in lines), err
    assert "planc: rank 0 exited with status 1" in err


def _with_instruction(build: Path, node: str, change) -> int:
    """Every instruction of ``node`` in the build's programs changed by ``change``
    (operands -> None); how many there were."""
    changed = 0
    for path in sorted((build / "programs").glob("stage*.json")):
        program = json.loads(path.read_text())

        def walk(value):
            nonlocal changed
            if isinstance(value, dict):
                if value.get("node") == node and "operands" in value:
                    change(value["operands"])
                    changed += 1
                for item in value.values():
                    walk(item)
            elif isinstance(value, list):
                for item in value:
                    walk(item)
        walk(program)
        path.write_text(json.dumps(program))
    return changed


def test_check_fails_on_wrong_parameters_whose_losses_match(tmp_path, capfd):
    """One step of dp 2 whose gradient reduction runs over a group of one rank (tp's,
    here): each rank steps with its own half batch's gradient. Step 0's loss comes
    before it and matches, so only the parameters can fail the check, and must."""
    build = _compiled(tmp_path, "dp-zero0", capfd)
    assert _with_instruction(build, "G/c0.b0:all_reduce@dp_cp",
                             lambda operands: operands.update(group="tp")) == 1
    status, err = run([build, "--steps", 1, "--check", "--no-verify"], capfd)
    assert status == 1, err
    lines = [line.removeprefix("[rank 0] ") for line in err.splitlines()]
    step = next(line for line in lines if line.startswith("  step 0: loss "))
    assert not step.endswith("MISMATCH"), err
    assert any(line.startswith("  embedding.weight (replica dp 1, cp 0): largest difference")
               and line.endswith("  MISMATCH") for line in lines), err


def test_check_fails_on_one_wrong_element_of_a_small_tensor_under_adamw(tmp_path, capfd):
    """A tp sum of the layer norms' gradients one element short (tp 2, dp 2, sequence
    parallelism, ZeRO-2, AdamW): one element of a 32-element weight off by 4 x lr. AdamW's
    allowance for amplified rounding (a few elements of a large tensor) passed it."""
    plan = tmp_path / "spa.plan"
    plan.write_text(plan_text("spa", **MATRIX["dp-zero2-sp"]).replace(
        "sgd(lr = 0.5, momentum = 0.9)", "adamw(lr = 1e-3)"))
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    short = _with_instruction(tmp_path / "b", "G/c0.b0:all_reduce@tp",
                              lambda operands: operands.update(
                                  elements=[0, operands["elements"][1] - 1]))
    assert short == 1
    status, err = run([tmp_path / "b", "--steps", 3, "--check", "--no-verify"], capfd)
    assert status == 1, err
    assert "  layers.0.ln1.weight (replica dp 0, cp 0): largest difference " in err


def test_check_reports_each_loss_evaluation_and_replica_that_differs():
    """--check's report, line by line (planc.runtime.oracle.check): a loss or an
    evaluation off by more than the tolerance, a missing one, a replica whose copy
    differs while the others match, a parameter no rank sent, one of another shape."""
    from planc.runtime.oracle.check import evaluation_report, loss_report, parameter_report

    lines, failed = loss_report([2.0, 1.5], [2.0, 1.0], 0, [1e-5, 1e-5])
    assert failed and lines == [
        "  step 0: loss 2.00000000, single process 2.00000000, relative error 0.00e+00",
        "  step 1: loss 1.50000000, single process 1.00000000, relative error 5.00e-01  "
        "MISMATCH"]
    assert loss_report([1.0], [2.0, 1.0], 1, [1e-5, 1e-5]) == (
        ["  step 1: loss 1.00000000, single process 1.00000000, relative error 0.00e+00"],
        False)  # resumed at step 1
    lines, failed = loss_report([2.0], [2.0, 1.0], 0, [1e-5, 1e-5])
    assert failed and lines[-1] == "  the run reported 1 losses for steps 0 to 1  MISMATCH"
    lines, failed = evaluation_report({2: 3.0}, {2: 3.0, 4: 2.5}, 0, 1e-5)
    assert failed and lines == [
        "  evaluation after step 2: loss 3.00000000, single process 3.00000000, relative "
        "error 0.00e+00",
        "  evaluation after step 4: loss missing, single process 2.50000000, relative error "
        "inf  MISMATCH"]
    assert evaluation_report({4: 2.5}, {2: 3.0, 4: 2.5}, 3, 1e-5)[1] is False
    want = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    replicas = [(0, 0), (1, 0)]
    copies = {("w", 0, 0): {0: {0: want["w"].clone()}},
              ("w", 1, 0): {0: {0: torch.tensor([1.0, -2.1])}},  # replica 1 only
              ("b", 0, 0): {0: {0: torch.tensor([0.5, 0.5])}}}  # another shape; none on 1
    worst, lines, amplified = parameter_report(None, want, copies, {}, replicas, 1e-5, 0.0)
    assert amplified == [] and lines == [
        "  w (replica dp 1, cp 0): largest difference 1.00e-01, relative 5.00e-02  MISMATCH",
        "  b (replica dp 0, cp 0): the run's copy does not have the shape [1]  MISMATCH",
        "  b (replica dp 1, cp 0): no rank holds it  MISMATCH"]
    assert worst[2] == "w" and worst[1] == pytest.approx(0.1, rel=1e-6)
    copies[("w", 1, 0)] = {0: {0: want["w"].clone()}}
    copies[("b", 0, 0)] = copies[("b", 1, 0)] = {0: {0: want["b"].clone()}}
    assert parameter_report(None, want, copies, {}, replicas, 1e-5, 0.0) == (
        (0.0, 0.0, ""), [], [])
    # AdamW's amplified rounding: one element in 10,000 past the slack but within the
    # ceiling passes, and is named; more, or one past the ceiling, do not; of a tensor
    # under 10,000 elements, none
    many = {"e": torch.zeros(20000)}
    drifted = many["e"].clone()
    drifted[7] = 0.05
    same = [(0, 0)]
    assert parameter_report(None, many, {("e", 0, 0): {0: {0: drifted}}}, {}, same, 1e-5,
                            0.01, 0.06) == (
        (0.0, 0.0, ""), [], ["e: 1 of 20,000 elements, up to 5.0e-02"])
    drifted[8] = drifted[9] = 0.02
    assert parameter_report(None, many, {("e", 0, 0): {0: {0: drifted}}}, {}, same, 1e-5,
                            0.01, 0.06)[1] == [
        "  e: largest difference 5.00e-02, relative 5.00e+10  MISMATCH"]
    drifted[8] = drifted[9] = 0.0
    small = {"e": torch.zeros(32)}  # one element of 32 (within the ceiling): an error
    assert parameter_report(None, small, {("e", 0, 0): {0: {0: drifted[:32]}}}, {}, same,
                            1e-5, 0.01, 0.06)[1] == [
        "  e: largest difference 5.00e-02, relative 5.00e+10  MISMATCH"]
    assert parameter_report(None, many, {("e", 0, 0): {0: {0: drifted}}}, {}, same, 1e-5,
                            0.01, 0.04)[1] == [
        "  e: largest difference 5.00e-02, relative 5.00e+10  MISMATCH"]


def test_bf16_with_adamw_compares_losses_and_says_why_not_parameters(tmp_path, capfd):
    text = plan_text("half", mesh="tp = 2", model="; dtype = bf16").replace(
        "sgd(lr = 0.5, momentum = 0.9)", "adamw(lr = 0.01)")
    (tmp_path / "h.plan").write_text(text)
    status, err = run([tmp_path / "h.plan", "-o", tmp_path / "b", "--check"], capfd)
    assert status == 0, err
    assert ("check: 2 steps and no parameters (bf16/fp16 with AdamW, see below) against the "
            "single-process run (relative tolerance 0.02): every loss matches.") in err


@pytest.mark.parametrize("flag", ["--metrics", "--trace"])
def test_an_unwritable_output_path_is_refused_before_anything_runs(flag, tmp_path, capfd):
    plan = tmp_path / "p.plan"
    plan.write_text(plan_text("p"))
    status, err = run([plan, "-o", tmp_path / "b", flag, tmp_path / "missing" / "m.json"], capfd)
    assert status == 1
    assert err == (f"planc: error: {flag} {tmp_path / 'missing' / 'm.json'}: cannot write "
                   f"there ({tmp_path / 'missing'} does not exist)\n")
    assert not (tmp_path / "b").exists()
    status, err = run([plan, "-o", tmp_path / "b", flag, tmp_path], capfd)
    assert status == 2
    assert err == f"planc: error: {flag} {tmp_path}: is a directory; name a file\n"



def test_check_holds_the_documented_tolerances_exactly():
    """Relative 1e-5 for losses, evaluations and parameters in fp32 (docs/programs.md),
    AdamW's slack 0.1 lr a step, and its ceiling twice Adam's largest step (Kingma and Ba
    2015, section 2.1: lr (1 - beta1) / sqrt(1 - beta2) for the default betas), each
    tight: a difference of twice the tolerance fails, half of it passes."""
    from planc.lang import load_text
    from planc.runtime.oracle.check import (amplified_ceiling, evaluation_report,
                                            loss_report, parameter_report, update_floor)

    assert loss_report([1.0 + 2e-5], [1.0], 0, [1e-5])[1] is True
    assert loss_report([1.0 + 5e-6], [1.0], 0, [1e-5])[1] is False
    assert evaluation_report({1: 1.0 + 2e-5}, {1: 1.0}, 0, 1e-5)[1] is True
    assert evaluation_report({1: 1.0 + 5e-6}, {1: 1.0}, 0, 1e-5)[1] is False
    want = {"w": torch.tensor([1.0, -2.0])}
    one = [(0, 0)]
    for off, failed in ((4e-5, True), (1e-5, False)):  # scale 2: allowed 2e-5
        copy = torch.tensor([1.0, -2.0 - off])
        assert bool(parameter_report(None, want, {("w", 0, 0): {0: {0: copy}}}, {}, one,
                                     1e-5, 0.0)[1]) is failed
    # every tp rank's copy of a replicated parameter, not only the first
    copies = {("w", 0, 0): {0: {0: want["w"].clone(), 1: torch.tensor([1.0, -2.001])}}}
    assert parameter_report(None, want, copies, {"w": None}, one, 1e-5, 0.0)[1] == [
        "  w: largest difference 1.00e-03, relative 5.00e-04  MISMATCH"]
    adamw = load_text(plan_text("a", mesh="dp = 2").replace(
        "sgd(lr = 0.5, momentum = 0.9)", "adamw(lr = 1e-3)")).plan
    assert update_floor(adamw, 4) == pytest.approx(0.1 * 1e-3 * 4, rel=1e-12)
    assert amplified_ceiling(adamw, 3) == pytest.approx(2 * 1e-3 * 3 * 0.1 / 0.001 ** 0.5,
                                                        rel=1e-12)


def test_the_hang_report_names_each_streams_next_instruction_by_its_index():
    """Guards CpuExecutor._hang_report: each stream's next instruction by its rank-wide index."""
    from types import SimpleNamespace

    from planc.compile import compile_plan
    from planc.lang import load_text
    from planc.program import step_code
    from planc.runtime.engine.executor import CpuExecutor

    build = compile_plan(load_text(plan_text("hang", **MATRIX["pp-1f1b-uneven"])).plan)
    code = step_code.generate(build.programs["stage1.json"])
    assert [(s.name, len(s.items)) for s in code.streams] == [
        ("recv_prev", 8), ("compute", 277), ("send_prev", 8), ("comm", 2)]
    ctx = SimpleNamespace(rank=1, stage=1, tp_rank=0, cp_rank=0, coords={"dp": 0})
    executor = SimpleNamespace(interpreter=SimpleNamespace(ctx=ctx, bound={}), timeout=3.0,
                               code=code)
    # recv_prev 3 instructions in, compute at its last one, send_prev done, comm at its first
    work = SimpleNamespace(done=[3, 276, 8, 0])
    recv, compute, comm = (code.streams[0].items[3], code.streams[1].items[276],
                           code.streams[3].items[0])
    # rank-wide indices, which differ from the streams' own counts
    assert (recv.index, compute.index, comm.index) == (74, 294, 256)
    assert CpuExecutor._hang_report(executor, work, 0).splitlines() == [
        "rank 1 (stage 1, tp 0, cp 0, dp 0) made no progress for 3 s in step 0; its streams "
        "wait on:",
        "  recv_prev: #74 record done:F/c0>c1:recv@pp#1",
        "  compute: #294 compute O/c1.b0/optimizer",
        "  send_prev: nothing (finished)",
        "  comm: #256 wait done:F/loss#3"]


def test_check_fails_when_only_an_evaluation_differs(monkeypatch, capsys):
    """Guards oracle.check.compare: an evaluation off by more than the tolerance fails --check."""
    from types import SimpleNamespace

    from planc.lang import load_text
    from planc.runtime.oracle import check, reference

    plan = load_text(plan_text("ev", mesh="").replace("steps = 2", "steps = 4").replace(
        "seed = 3 }", "seed = 3; eval_every = 2; eval_batches = 2 }")).plan
    evaluations: dict[int, float] = {}
    losses, params = reference.train(plan, 4, None, evaluations)
    assert sorted(evaluations) == [1, 3]
    ctx = SimpleNamespace(data_identity=None, device=torch.device("cpu"), model=None)

    def run_gave(evaluated):  # the reference's own losses and parameters: only these differ
        return lambda *_: (losses, {(name, 0, 0): {0: {0: value}} for name, value in
                                    params.items()}, dict.fromkeys(params), evaluated)

    header = ("check: 4 steps and 53 parameters and 2 evaluations against the single-process "
              "run (relative tolerance 1e-05): ")
    monkeypatch.setattr(check, "_gather_parameters", run_gave(dict(evaluations)))
    assert check.compare(ctx, None, plan.to_dict(), losses, 4) == 0
    assert capsys.readouterr().err.startswith(header + "every loss and parameter matches")
    wrong = {**evaluations, 3: evaluations[3] + 0.01}
    monkeypatch.setattr(check, "_gather_parameters", run_gave(wrong))
    assert check.compare(ctx, None, plan.to_dict(), losses, 4) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == header + "FAILED"
    assert [line for line in err if line.endswith("MISMATCH")] == [
        f"  evaluation after step 3: loss {wrong[3]:.8f}, single process "
        f"{evaluations[3]:.8f}, relative error {0.01 / evaluations[3]:.2e}  MISMATCH"]

"""Checkpoints that move between plans (planc run --checkpoint-dir / --resume).

Real ``planc run`` processes (gloo, 2 to 4 ranks): a run interrupted by a checkpoint and
resumed under another layout (tp, pp, dp, ZeRO 1 and 3, a tied embedding, AdamW) follows
the uninterrupted run's losses and ends with its parameters, within the tolerances of
``planc run --check``; a run killed while checkpointing, or a checkpoint directory
holding a partial step, leaves the previous checkpoint usable; a bad --resume is one line
and exit 1 (a checkpoint is an input, tests/test_damaged_checkpoints.py), a bad checkpoint
flag one line and exit 2 (the command line), with nothing run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from planc.checkpoint.training_record import TrainingRecord
from planc.checkpoint import format as fmt  # noqa: E402
from planc.cli import main  # noqa: E402
from planc.lang import load_text  # noqa: E402
from planc.runtime.oracle.check import update_floor  # noqa: E402
from planc.runtime.checkpoint.checkpoints import boxes  # noqa: E402
from planc.runtime.engine import router_bias  # noqa: E402
from tests.conftest import ROOT, free_port  # noqa: E402

pytestmark = pytest.mark.slow

TEMPLATE = """plan {name} {{
  model {family} {{ layers = 4; hidden = {hidden}; heads = 4; vocab = {vocab}
    seq = 16; batch = 8{model} }}
  mesh {{ {mesh} }}
  shard {{ {shard} }}
  schedule {{ microbatches = {m} }}
  train {{ steps = {steps}; optimizer = {optimizer}; seed = 3{train} }}
}}
"""
SGD = "sgd(lr = 0.5, momentum = 0.9)"
ADAMW = "adamw(lr = 0.01, weight_decay = 0.1)"
LLAMA = "; kv_heads = 2; ffn = 96"


def plan_text(name: str, **case) -> str:
    values = dict(family="gpt", model="", mesh="", shard="", m=2, steps=4, optimizer=SGD,
                  hidden=32, vocab=128, train="")
    values.update(case)
    return TEMPLATE.format(name=name, **values)


def write_plan(directory: Path, name: str, **case) -> Path:
    path = directory / f"{name}.plan"
    path.write_text(plan_text(name, **case))
    return path


def run(args: list, capfd) -> tuple[int, str]:
    status = main(["run", *map(str, args)])
    return status, capfd.readouterr().err


def losses_of(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def tensors_of(step_dir: Path, kind: str = "model") -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(step_dir.glob(f"{kind}-*.safetensors")):
        out.update(load_file(str(path)))
    return out


# --- resuming under another layout ----------------------------------------------------------

# (plan A, which trains steps 0 and 1; plan B, which resumes and trains steps 2 and 3)
CASES = {
    "tp2-to-pp2xdp2-zero1": (dict(mesh="tp = 2"),
                             dict(mesh="pp = 2; dp = 2", shard="dp { zero = 1 }")),
    "tp2-sp-to-dp2-zero3": (dict(mesh="tp = 2", shard="tp { sequence_parallel = on }"),
                            dict(mesh="dp = 2", shard="dp { zero = 3 }")),
    "adamw-zero3-to-tp2xpp2": (dict(mesh="dp = 2", shard="dp { zero = 3 }", optimizer=ADAMW),
                               dict(mesh="tp = 2; pp = 2", optimizer=ADAMW)),
    "tied-pp2-to-cp2-zero1": (dict(mesh="pp = 2", model="; tie_embeddings = on"),
                              dict(mesh="cp = 2; dp = 2", shard="dp { zero = 1 }",
                                   model="; tie_embeddings = on")),
    # grouped-query attention: under tp = 4 two ranks share each of the 2 k/v heads
    "llama-gqa-tp4-to-pp2xdp2-zero1": (
        dict(family="llama", model=LLAMA, mesh="tp = 4", optimizer=ADAMW),
        dict(family="llama", model=LLAMA, mesh="pp = 2; dp = 2", shard="dp { zero = 1 }",
             optimizer=ADAMW)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_run_resumed_under_another_layout_matches_the_uninterrupted_run(name, tmp_path,
                                                                          capfd):
    resumed_run_matches_uninterrupted(*CASES[name], tmp_path, capfd)


def resumed_run_matches_uninterrupted(case_a: dict, case_b: dict, tmp_path: Path,
                                      capfd) -> str:
    """Plan A trains 4 steps uninterrupted, and 2 steps with a checkpoint that plan B
    resumes for 2 more: the same losses, parameters and optimizer state; what the resumed
    run wrote to stderr."""
    a = write_plan(tmp_path, "a", **case_a)
    b = write_plan(tmp_path, "b", **case_b)
    # the uninterrupted run: 4 steps on A; its final checkpoint holds the final parameters
    status, err = run([a, "-o", tmp_path / "build-a", "--metrics", tmp_path / "full.jsonl",
                       "--checkpoint-dir", tmp_path / "full"], capfd)
    assert status == 0, err
    # 2 steps on A with a checkpoint, then 2 more on B from it (--check: the resumed run
    # against one process trained from step 0)
    status, err = run([a, "-o", tmp_path / "build-a", "--steps", 2, "--metrics",
                       tmp_path / "first.jsonl", "--checkpoint-dir", tmp_path / "ckpt"], capfd)
    assert status == 0, err
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000002\n"
    status, err = run([b, "-o", tmp_path / "build-b", "--resume", tmp_path / "ckpt",
                       "--metrics", tmp_path / "second.jsonl", "--checkpoint-dir",
                       tmp_path / "ckpt", "--check"], capfd)
    assert status == 0, err
    resumed_err = err
    assert "steps 2..3, resumed from" in err
    assert "check: 2 steps (from step 2, resumed)" in err
    assert "every loss and parameter matches" in err

    plan = load_text(a.read_text()).plan
    tolerance, floor = 1e-5, update_floor(plan, 4)  # planc run --check's, fp32
    full = losses_of(tmp_path / "full.jsonl")
    resumed = {**losses_of(tmp_path / "first.jsonl"), **losses_of(tmp_path / "second.jsonl")}
    assert sorted(full) == sorted(resumed) == [0, 1, 2, 3]
    for step in full:
        assert abs(resumed[step] - full[step]) <= tolerance * abs(full[step]), step
    want = tensors_of(tmp_path / "full" / "step-000004")
    got = tensors_of(tmp_path / "ckpt" / "step-000004")
    assert set(got) == set(want) and len(want) >= 30
    for key, value in want.items():
        allowed = tolerance * float(value.abs().max()) + floor
        assert float((got[key] - value).abs().max()) <= allowed, key
    # the optimizer state went through the other layout too
    want_state = tensors_of(tmp_path / "full" / "step-000004", "optimizer")
    got_state = tensors_of(tmp_path / "ckpt" / "step-000004", "optimizer")
    assert set(got_state) == set(want_state)
    keys = fmt.state_keys(TrainingRecord.of(plan.to_dict()).optimizer)
    untrained = len(router_bias.shapes(plan.model))  # a mixture's balancing biases
    assert len(want_state) == len(keys) * (len(want) - untrained)
    if plan.train.optimizer.name == "sgd":  # momentum: as exact as the parameters
        for key, value in want_state.items():
            assert torch.allclose(got_state[key], value, rtol=0,
                                  atol=tolerance * float(value.abs().max()) + 1e-7), key
    manifest = json.loads((tmp_path / "ckpt" / "step-000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["data"]["next_step"] == 4
    assert manifest["model"] == TrainingRecord.of(plan.to_dict()).model
    assert [(h["plan"], h["first_step"], h["last_step"]) for h in manifest["history"]] == \
        [("a", 0, 1), ("b", 2, 3)]
    if plan.train.optimizer.name == "adamw":
        assert manifest["optimizer"]["steps"] == 4
    return resumed_err


def test_a_resumed_run_continues_the_lr_schedule_and_the_shuffled_samples(tmp_path, capfd):
    """2 steps, then 2 more resumed from the checkpoint of step 2, under a cosine schedule
    with a warm-up step and the corpus's samples shuffled: the same lr, losses and
    parameters as 4 steps in one go (the step number is in the checkpoint; the lr and the
    samples of step k depend on k alone). The gradients are clipped every step (C = 0.05,
    far below their norm) and evaluated every 2 steps: the resumed run clips as the
    single process does (--check), and evaluates after steps 2 and 4 as the whole run
    does, since evaluations count steps from the run's start."""
    from planc.plan.lr_schedule import lr_at
    from planc.data.corpus import main as make_corpus

    assert make_corpus(["-o", str(tmp_path / "corpus.tokens")]) == 0
    train = ('; lr_schedule = cosine(warmup = 1, min_lr = 0.05); shuffle = on; '
             'data = "corpus.tokens"; grad_clip = 0.05; eval_every = 2; eval_batches = 2')
    resumed_err = resumed_run_matches_uninterrupted(
        dict(mesh="tp = 2", shard="tp { sequence_parallel = on }", vocab=1024, train=train),
        dict(mesh="dp = 2", shard="dp { zero = 1 }", vocab=1024, train=train), tmp_path, capfd)
    schedule = load_text(plan_text("a", vocab=1024, train=train)).plan.train.lr_schedule
    records = [json.loads(line) for name in ("full", "first", "second")
               for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    expected = [lr_at(schedule, 0.5, 4, k) for k in range(4)]
    assert [r["lr"] for r in records] == expected + expected
    assert all(r["grad_norm"] > 10 * 0.05 for r in records)  # every step clipped
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 3, 1, 3]
    assert "check: 2 steps (from step 2, resumed) and " in resumed_err
    assert "and 1 evaluation against the single-process run" in resumed_err
    assert expected == pytest.approx([0.25, 0.5, 0.3875, 0.1625], rel=1e-15)
    # each segment of the history says which schedule and order trained it
    from planc.checkpoint.manifest import check_manifest

    path = tmp_path / "ckpt" / "step-000004" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert [(s["lr_schedule"], s["shuffle"]) for s in manifest["history"]] == [
        ({"name": "cosine", "warmup": 1, "min_lr": 0.05, "decay": 0}, True)] * 2
    for key, value, field in (("shuffle", False, "history[1].shuffle"),
                              ("lr_schedule", {"name": "cosine"},
                               "history[1].lr_schedule.warmup"),
                              ("lr_schedule", [], "history[1].lr_schedule")):
        damaged = json.loads(json.dumps(manifest))
        damaged["history"][1][key] = value
        with pytest.raises(fmt.CheckpointError, match=re.escape(f"{path}: {field} ")):
            check_manifest(damaged, path)


# --- a run killed while checkpointing ----------------------------------------------------


def _being_written(ckpt: Path) -> bool:
    """Whether a checkpoint's staging directory holds files: a writer is at work."""
    for staging in ckpt.glob(".step-*.partial"):
        try:
            if any(staging.iterdir()):
                return True
        except OSError:  # committed (renamed) since it was listed
            continue
    return False


@pytest.mark.parametrize("flags", [[], ["--checkpoint-async"]], ids=["sync", "async"])
def test_a_run_killed_while_checkpointing_leaves_the_previous_checkpoint_usable(flags, tmp_path,
                                                                                capfd):
    """kill -9 of the run in a step or in a checkpoint's writing (with --checkpoint-async,
    while its thread writes and the next steps train): the newest complete checkpoint
    resumes and matches the single-process run."""
    plan = write_plan(tmp_path, "k", mesh="dp = 2", shard="dp { zero = 1 }", steps=400)
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    ckpt = tmp_path / "ckpt"
    process = subprocess.Popen([sys.executable, "-m", "planc", "run", str(tmp_path / "b"),
                                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                                *flags],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the kill lands while a checkpoint is written
            latest = ckpt / "latest"
            if latest.exists() and latest.read_text().strip() >= "step-000003" and \
                    _being_written(ckpt):
                break
            time.sleep(0.001)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert _being_written(ckpt), "the run was not killed while it wrote a checkpoint"
    found = fmt.find(ckpt)  # every file checked against its sha256
    step = found.manifest["step"]
    assert step >= 3 and found.directory == ckpt / fmt.step_name(step)
    # Resume from it for one more step, compared with one process trained from step 0.
    status, err = run([tmp_path / "b", "--resume", ckpt, "--steps", step + 1, "--check",
                       "--checkpoint-dir", ckpt], capfd)
    assert status == 0, err
    assert f"resumed from {ckpt / fmt.step_name(step)} at step {step}" in err
    assert "every loss and parameter matches" in err
    assert fmt.find(ckpt).manifest["step"] == step + 1


def test_a_temporary_file_of_latest_left_by_a_killed_run_does_not_block_the_directory(
        tmp_path):
    """A run killed between writing `latest`'s temporary file and renaming it leaves
    .planc-XXXXXXXX beside the steps (found by the kill test above under pytest-xdist);
    the directory is still a checkpoint directory, and a stranger's file still is not."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".planc-k2x_9qzr").write_text("step-0000")
    assert fmt.writable_problem(str(ckpt)) is None
    (ckpt / "notes.txt").write_text("mine")
    assert fmt.writable_problem(str(ckpt)) == (
        f"--checkpoint-dir {ckpt}: holds 'notes.txt', which is not a checkpoint; name an "
        f"empty or a checkpoint directory")


def test_incomplete_and_damaged_steps_are_passed_over(tmp_path, capfd):
    plan = write_plan(tmp_path, "p", mesh="tp = 2", steps=2)
    ckpt = tmp_path / "ckpt"
    status, err = run([plan, "-o", tmp_path / "b", "--checkpoint-dir", ckpt,
                       "--checkpoint-every", 1], capfd)
    assert status == 0, err
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000001", "step-000002"]
    good = ckpt / "step-000002"
    # What a writer killed at various points leaves: a staging directory with a truncated
    # file; a newer step directory without its manifest (written last); a step directory
    # whose manifest is truncated; `latest` naming one of them.
    staging = ckpt / ".step-000003.partial"
    shutil.copytree(good, staging)
    model = staging / "model-00000-of-00001.safetensors"
    model.write_bytes(model.read_bytes()[:1000])
    no_manifest = ckpt / "step-000004"
    shutil.copytree(good, no_manifest)
    (no_manifest / "manifest.json").unlink()
    cut = ckpt / "step-000005"
    shutil.copytree(good, cut)
    text = (cut / "manifest.json").read_text()
    (cut / "manifest.json").write_text(text[:len(text) // 2])
    (ckpt / "latest").write_text("step-000005\n")
    found = fmt.find(ckpt)
    assert found.directory == good
    assert len(found.skipped) == 2
    # A newer step with a manifest but a truncated data file (damaged after it was
    # written) is passed over too, with a warning naming the file.
    damaged = ckpt / "step-000006"
    shutil.copytree(good, damaged)
    data = damaged / "optimizer-00000-of-00001.safetensors"
    data.write_bytes(data.read_bytes()[:-8])
    found = fmt.find(ckpt)
    assert found.directory == good
    assert any("optimizer-00000-of-00001.safetensors has" in s for s in found.skipped)
    # An older step copied under a newer step's name is not taken for the newest: the
    # newest is chosen by name, the step is the manifest's.
    renamed = ckpt / "step-000007"
    shutil.copytree(ckpt / "step-000001", renamed)
    found = fmt.find(ckpt)
    assert found.directory == good
    assert (f"{renamed} holds the checkpoint of step 1, not of the step its name says"
            in found.skipped)
    status, err = run([plan, "-o", tmp_path / "b", "--resume", ckpt, "--steps", 3, "--check"],
                      capfd)
    assert status == 0, err
    assert "planc: warning: --resume passed over a checkpoint: " in err and "step-000006" in err
    assert f"resumed from {good} at step 2" in err
    assert "check: 1 step (from step 2, resumed)" in err
    # the staging directory of a killed writer does not block writing that step again
    status, err = run([plan, "-o", tmp_path / "b", "--resume", good, "--steps", 3,
                       "--checkpoint-dir", ckpt], capfd)
    assert status == 0, err
    assert fmt.find(ckpt).directory == ckpt / "step-000003"
    assert not staging.exists()


# --- bad input: one line, exit 1 (a checkpoint) or 2 (a flag), nothing run ----------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step checkpoint of a tp = 2 plan."""
    base = tmp_path_factory.mktemp("saved")
    plan = write_plan(base, "s", mesh="tp = 2", steps=2)
    status = main(["run", str(plan), "-o", str(base / "b"), "--checkpoint-dir",
                   str(base / "ckpt")])
    assert status == 0
    return base / "ckpt"


def _refused(args: list, capfd, tmp_path: Path, expected: int = 1) -> str:
    status, err = run([*args, "-o", tmp_path / "never"], capfd)
    assert status == expected, err
    assert "Traceback" not in err
    lines = err.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("planc: error: "), err
    assert not (tmp_path / "never").exists()  # nothing compiled, nothing run
    return lines[0]


def test_bad_resume_inputs_are_one_line_and_exit_1(saved, tmp_path, capfd):
    capfd.readouterr()
    plan = write_plan(tmp_path, "p", mesh="dp = 2")
    missing = tmp_path / "nowhere"
    assert _refused([plan, "--resume", missing], capfd, tmp_path) == \
        f"planc: error: --resume: {missing}: no such checkpoint directory"
    a_file = tmp_path / "p.plan"
    assert "is not a directory" in _refused([plan, "--resume", a_file], capfd, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no checkpoint" in _refused([plan, "--resume", empty], capfd, tmp_path)
    # another model: every key that differs is named
    other = write_plan(tmp_path, "other", mesh="dp = 2", hidden=64, vocab=256)
    line = _refused([other, "--resume", saved], capfd, tmp_path)
    assert "the checkpoint's model differs from the plan's: ffn = 128 in the checkpoint, 256 " \
           "in the plan; hidden = 32 in the checkpoint, 64 in the plan; vocab = 128 in the " \
           "checkpoint, 256 in the plan; nothing was run" in line
    tied = write_plan(tmp_path, "tied", mesh="dp = 2", model="; tie_embeddings = on")
    assert "tie_embeddings = false in the checkpoint, true in the plan" in \
        _refused([tied, "--resume", saved], capfd, tmp_path)
    # another optimizer, or the same one with other hyper-parameters
    adamw = write_plan(tmp_path, "adamw", mesh="dp = 2", optimizer=ADAMW)
    assert "the checkpoint's optimizer differs from the plan's" in \
        _refused([adamw, "--resume", saved], capfd, tmp_path)
    # nothing left to run: the checkpoint is at step 2 and the plan ends at step 2
    line = _refused([plan, "--resume", saved, "--steps", 2], capfd, tmp_path)
    assert "the checkpoint is at step 2 and the run ends at step 2" in line
    # --check needs the checkpoint's steps trained with the plan's seed and data
    seeded = tmp_path / "seeded.plan"
    seeded.write_text(plan_text("seeded", mesh="dp = 2").replace("seed = 3", "seed = 4"))
    assert "were trained with seed 3 (the plan: 4)" in \
        _refused([seeded, "--resume", saved, "--check"], capfd, tmp_path)
    # ... and its lr schedule and sample order
    scheduled = write_plan(tmp_path, "scheduled", mesh="dp = 2",
                           train="; lr_schedule = cosine(warmup = 1)")
    assert "were trained with lr_schedule constant (the plan: cosine(warmup = 1, min_lr = " \
           "0.0, decay = 0))" in \
        _refused([scheduled, "--resume", saved, "--check"], capfd, tmp_path)
    shuffled = write_plan(tmp_path, "shuffled", mesh="dp = 2", train="; shuffle = on")
    status, err = run([shuffled, "--resume", saved, "--check", "-o", tmp_path / "never"], capfd)
    assert status == 1 and "warning: shuffle = on changes nothing" in err  # synthetic data
    assert "were trained with shuffle off (the plan: on); nothing was run" in \
        err.strip().split("\n")[-1]
    # a step directory without a manifest, named directly
    partial = tmp_path / "ckpt" / "step-000002"
    shutil.copytree(saved / "step-000002", partial)
    (partial / "manifest.json").unlink()
    assert "is not a complete checkpoint (no manifest.json" in \
        _refused([plan, "--resume", partial], capfd, tmp_path)


def test_a_checkpoint_directory_of_what_planc_did_not_write_is_refused(saved, tmp_path,
                                                                         capfd):
    """A run writes latest in place, replaces a step directory whole and removes staging
    directories: a link there (latest linked to a file elsewhere was overwritten through
    it), a file of the user's inside a step directory (removed by --force) or under a
    step's name, or a staging directory read as a checkpoint, is refused before anything
    runs, and changes nothing."""
    capfd.readouterr()
    plan = write_plan(tmp_path, "p", mesh="tp = 2", steps=3)
    elsewhere = tmp_path / "precious.txt"
    elsewhere.write_text("precious")

    def refused(make, *flags):
        ckpt = tmp_path / f"c{len(list(tmp_path.glob('c*')))}"
        shutil.copytree(saved, ckpt)
        make(ckpt)
        before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
        line = _refused([plan, "--checkpoint-dir", ckpt, *flags], capfd, tmp_path, 2)
        assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
        return line.replace(f"{ckpt}", "D")

    tail = ("; planc writes, replaces and removes only what it wrote there: move it, or "
            "name another directory")

    def link_latest(ckpt):
        (ckpt / "latest").unlink()
        (ckpt / "latest").symlink_to(elsewhere)
    assert refused(link_latest, "--resume", saved) == \
        f"planc: error: --checkpoint-dir D: latest is a symbolic link{tail}"
    assert elsewhere.read_text() == "precious"
    assert refused(lambda c: (c / "step-000002" / "notes.txt").write_text("mine"),
                   "--force") == \
        f"planc: error: --checkpoint-dir D: step-000002/notes.txt is not a file of a " \
        f"checkpoint{tail}"
    assert refused(lambda c: (c / "step-000003").write_text("mine"), "--force") == \
        f"planc: error: --checkpoint-dir D: step-000003 is a file, not a checkpoint's " \
        f"directory{tail}"
    assert refused(lambda c: (c / ".step-000003.partial").symlink_to(tmp_path),
                   "--force") == \
        f"planc: error: --checkpoint-dir D: .step-000003.partial is a symbolic link{tail}"
    # a resumed run continues its own metrics, not another plan's
    metrics = tmp_path / "other.jsonl"
    metrics.write_text('{"step": 0, "time_s": 0.1, "loss": 1.0, "plan": "other"}\n')
    assert _refused([plan, "--resume", saved, "--metrics", metrics], capfd, tmp_path, 2) == (
        f"planc: error: --metrics {metrics}: holds the steps of plan other, and this run "
        f"trains plan p: a resumed run continues its own run's metrics; name another file")
    assert metrics.read_text() == '{"step": 0, "time_s": 0.1, "loss": 1.0, "plan": "other"}\n'
    staging = tmp_path / "staged" / ".step-000002.partial"
    shutil.copytree(saved / "step-000002", staging)
    assert _refused([plan, "--resume", staging], capfd, tmp_path) == (
        f"planc: error: --resume: {staging} is a checkpoint being written or replaced, "
        f"which is never read: name its checkpoint directory")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted", "index"])
def test_a_damaged_checkpoint_is_refused(damage, saved, tmp_path, capfd):
    capfd.readouterr()
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    step = copy / "step-000002"
    model = step / "model-00000-of-00001.safetensors"
    if damage == "flipped":  # same size, one byte of a tensor changed
        data = bytearray(model.read_bytes())
        data[-5] ^= 0xFF
        model.write_bytes(bytes(data))
        expected = "does not match its sha256 in the manifest (corrupted or replaced)"
    elif damage == "truncated":
        model.write_bytes(model.read_bytes()[:-100])
        expected = "the manifest says"
    elif damage == "deleted":
        model.unlink()
        expected = "is missing (the manifest lists it)"
    else:
        (step / "model.safetensors.index.json").write_text("{}")
        expected = "bytes, the manifest says"
    plan = write_plan(tmp_path, "p", mesh="dp = 2")
    line = _refused([plan, "--resume", step], capfd, tmp_path)
    assert expected in line and str(step) in line
    # the directory holding it has no other checkpoint: refused too, saying why
    line = _refused([plan, "--resume", copy], capfd, tmp_path)
    assert "holds no complete checkpoint" in line and expected in line


def test_resuming_under_another_lr_schedule_or_sample_order_warns(tmp_path, capfd):
    """As a seed or data file other than the checkpoint's does: the run goes on with the
    plan's, from the checkpoint's step, and says so (--check refuses it, above)."""
    from planc.data.tokens import write_tokens

    data = tmp_path / "t.tokens"
    write_tokens(data, [(7 * i) % 256 for i in range(4096)], 2)
    tiny = [ROOT / "plans" / "gpt-tiny.plan", "--set", f'train.data="{data}"']
    status, err = run([*tiny, "--steps", 2, "--checkpoint-dir", tmp_path / "ckpt", "-o",
                       tmp_path / "a"], capfd)
    assert status == 0, err
    for change, warning in [
            ("train.lr_schedule=cosine(warmup = 1)",
             "the checkpoint was trained with lr_schedule constant, the plan has cosine("
             "warmup = 1, min_lr = 0.0, decay = 0): steps from 2 on follow the plan's"),
            ("train.shuffle=on", "the checkpoint was trained with shuffle off, the plan has "
                                 "on: steps from 2 on read the plan's order of samples")]:
        status, err = run([*tiny, "--set", change, "--resume", tmp_path / "ckpt", "-o",
                           tmp_path / change.split("=")[0]], capfd)
        assert status == 0, err
        assert [line for line in err.splitlines() if "warning" in line] == \
            [f"planc: warning: {warning}"]
        assert "(steps 2..2, resumed from " in err


def test_bad_checkpoint_flags_are_one_line_and_exit_2(tmp_path, capfd):
    plan = write_plan(tmp_path, "p", mesh="dp = 2")
    assert _refused([plan, "--checkpoint-every", 2], capfd, tmp_path, 2) == \
        "planc: error: --checkpoint-every needs --checkpoint-dir"
    for flag, value in (("--checkpoint-every", 0), ("--checkpoint-every", 10**400),
                        ("--steps", 0), ("--steps", 10**20)):
        assert _refused([plan, "--checkpoint-dir", tmp_path / "c", flag, value], capfd,
                        tmp_path, 2) == f"planc: error: {flag} must be a number of steps " \
                                        f"from 1 to 10^12"
    assert "is the plan file this command reads" in _refused(
        [plan, "--checkpoint-dir", plan], capfd, tmp_path, 2)
    other = tmp_path / "other.txt"
    other.write_text("x")
    assert "is not a directory" in _refused([plan, "--checkpoint-dir", other], capfd, tmp_path, 2)
    other.unlink()
    assert "holds 'p.plan', which is not a checkpoint" in \
        _refused([plan, "--checkpoint-dir", tmp_path], capfd, tmp_path, 2)
    assert "is inside the build directory" in \
        _refused([plan, "--checkpoint-dir", tmp_path / "never" / "ckpt"], capfd, tmp_path, 2)
    with pytest.raises(SystemExit) as caught:  # argparse's own usage error
        main(["run", str(plan), "--checkpoint-every", "x"])
    assert caught.value.code == 2
    assert "--checkpoint-every: invalid int value: 'x'" in capfd.readouterr().err


def test_export_given_a_checkpoint_without_format_hf_says_format_hf(saved, tmp_path, capfd):
    """Chakra export needs a plan or a build; a checkpoint (its directory or a step of it)
    is a path of the wrong kind, and the line says what exports one."""
    capfd.readouterr()
    out = tmp_path / "out"
    for given in (saved, saved / "step-000002"):
        assert main(["export", str(given), "-o", str(out)]) == 2
        assert capfd.readouterr().err == (
            f"planc: error: {given} holds a planc checkpoint, not a build; to export it for "
            f"transformers (LlamaForCausalLM), add --format hf: planc export {given} "
            f"--format hf -o {out}\n")
    assert not out.exists()


def test_progress_and_checkpoint_lines_come_in_step_order(tmp_path, capfd):
    """pp = 2: rank 0 writes the checkpoints, rank 1 (the last stage) knows the loss and
    prints the progress. The launcher copies each rank's output on its own, so the
    checkpoint lines once came out of step with the progress (checkpoint 2 and 3 before
    step 2's line); the rank that prints the progress now says when a checkpoint is
    written, after its step's line."""
    plan = write_plan(tmp_path, "order", mesh="pp = 2")
    status, err = run([plan, "-o", tmp_path / "b", "--checkpoint-dir", tmp_path / "ckpt",
                       "--checkpoint-every", 1], capfd)
    assert status == 0, err
    events = []
    for line in err.splitlines():
        progress = re.match(r"\[rank (\d)\] \[[#-]+\] step (\d)/4  loss ", line)
        written = re.match(r"\[rank (\d)\] planc: checkpoint (\S+) written: step (\d), 7 files, "
                           r"[\d.]+ MB in [\d.]+ s$", line)
        if progress:
            events.append((int(progress.group(1)), "step", int(progress.group(2))))
        elif written:
            assert written.group(2) == str(tmp_path / "ckpt" / f"step-00000{written.group(3)}")
            events.append((int(written.group(1)), "checkpoint", int(written.group(3))))
    assert events == [(1, what, step) for step in range(1, 5)
                      for what in ("step", "checkpoint")], err


def test_the_worker_refuses_a_bad_resume_too(saved, tmp_path, capfd):
    """torchrun ... -m planc.runtime.worker --resume D checks the checkpoint on every rank."""
    plan = write_plan(tmp_path, "w", mesh="dp = 2", hidden=64)
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    port = str(free_port())
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", port, "-m", "planc.runtime.worker", str(tmp_path / "b"),
         "--resume", str(saved)], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "planc: error: the checkpoint's model differs from the plan's: ffn = 128 in the " \
           "checkpoint, 256 in the plan; hidden = 32 in the checkpoint, 64 in the plan" in \
        result.stderr
    assert result.stderr.count("planc: error:") == 1  # rank 0 says it, every rank stops
    assert "planc/runtime" not in result.stderr  # no traceback of planc's (torchrun has its own)


# --- resharding reads, and how long a checkpoint takes ------------------------------------


def test_boxes_cover_a_flat_range_exactly():
    import random

    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        total = 1
        for n in shape:
            total *= n
        first = rng.randint(0, total)
        last = rng.randint(first, total)
        tensor = torch.arange(total).view(shape)
        parts = [tensor[tuple(slice(a, b) for a, b in zip(s, e))].reshape(-1)
                 for s, e in boxes(shape, first, last)]
        got = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        assert got.tolist() == list(range(first, last)), (shape, first, last)
        assert len(parts) <= 2 * len(shape) - 1


def test_save_and_load_times_of_a_small_model(tmp_path, capfd):
    """Measured here: write (gather to each stage's writer, serialise, fsync, commit) and
    resume (each rank reads its slices), printed for the record."""
    size = dict(hidden=128, vocab=2048, optimizer=ADAMW, steps=2)
    a = write_plan(tmp_path, "a", mesh="tp = 2", **size)
    b = write_plan(tmp_path, "b", mesh="dp = 2", shard="dp { zero = 3 }", **size)
    status, err = run([a, "-o", tmp_path / "ba", "--steps", 1, "--checkpoint-dir",
                       tmp_path / "ckpt"], capfd)
    assert status == 0, err
    written = re.search(r"checkpoint \S+ written: step 1, \d+ files, ([\d.]+) MB in ([\d.]+) s",
                        err)
    assert written, err
    status, err = run([b, "-o", tmp_path / "bb", "--resume", tmp_path / "ckpt"], capfd)
    assert status == 0, err
    loaded = re.search(r"resumed from \S+ at step 1 in ([\d.]+) s \(at most ([\d.]+) MB read "
                       r"by one rank\)", err)
    assert loaded, err
    verified = re.search(r"sha256 and values verified in ([\d.]+) s", err)
    assert verified, err
    manifest = json.loads((tmp_path / "ckpt" / "step-000001" / "manifest.json").read_text())
    elements = sum(torch.Size(p["shape"]).numel() for p in manifest["parameters"].values())
    tensor_mb = 3 * 4 * elements / 1e6  # parameters, exp_avg, exp_avg_sq
    # ZeRO-3 over 2 ranks: each rank reads its half of the bucket, nothing more
    assert float(loaded.group(2)) <= 0.5 * tensor_mb + 0.01
    assert float(written.group(2)) < 30 and float(loaded.group(1)) < 30
    with capfd.disabled():
        print(f"\ncheckpoint of {elements:,} parameters with AdamW state "
              f"({written.group(1)} MB): written from tp = 2 in {written.group(2)} s; "
              f"files hashed and values checked by planc run in {verified.group(1)} s; "
              f"resumed under dp = 2, "
              f"ZeRO-3 in {loaded.group(1)} s, at most {loaded.group(2)} MB read by one "
              f"rank")


# --- asynchronous checkpoints -------------------------------------------------------------

def test_asynchronous_checkpoints_hold_what_synchronous_ones_do_and_resume(tmp_path, capfd):
    """--checkpoint-async (issue 39): the state is copied out at the step boundary and
    written by a thread while the next steps train; every checkpoint holds the same
    tensors, bit for bit, as the synchronous run's, the losses are the same, each step
    after a checkpoint records how long it waited for it, and a resume from one under
    another layout matches the single-process run."""
    plan = write_plan(tmp_path, "async", mesh="pp = 2; dp = 2", shard="dp { zero = 1 }",
                      optimizer=ADAMW)
    runs = {}
    for way, flags in (("sync", []), ("async", ["--checkpoint-async"])):
        status, err = run([plan, "-o", tmp_path / f"b-{way}", "--checkpoint-dir",
                           tmp_path / way, "--checkpoint-every", 1, "--metrics",
                           tmp_path / f"{way}.jsonl", *flags], capfd)
        assert status == 0, err
        assert err.count("planc: checkpoint ") == 4, err
        # each written by the writer thread while the steps went on, or at the boundary
        written = [line for line in err.splitlines() if "planc: checkpoint " in line]
        assert [line.endswith(" s, in the background") for line in written] == \
            [way == "async"] * 4, written
        runs[way] = [json.loads(line) for line in (tmp_path / f"{way}.jsonl").read_text()
                     .splitlines()]
    assert [r["loss"] for r in runs["sync"]] == [r["loss"] for r in runs["async"]]
    for way in runs:  # the steps after a checkpoint say what it cost them
        assert [r["step"] for r in runs[way] if "checkpoint_wait_s" in r] == [1, 2, 3]
        assert all(r["checkpoint_wait_s"] >= 0 for r in runs[way][1:])
    for step in range(1, 5):
        for kind in ("model", "optimizer"):
            ours = tensors_of(tmp_path / "async" / f"step-{step:06d}", kind)
            theirs = tensors_of(tmp_path / "sync" / f"step-{step:06d}", kind)
            assert ours.keys() == theirs.keys() and ours
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), (step, kind)
    assert (tmp_path / "async" / "latest").read_text().strip() == "step-000004"
    other = write_plan(tmp_path, "async", mesh="tp = 2", optimizer=ADAMW)
    status, err = run([other, "-o", tmp_path / "b-resumed", "--resume",
                       tmp_path / "async" / "step-000002", "--check"], capfd)
    assert status == 0, err
    assert "resumed from" in err and "every loss and parameter matches" in err


def test_checkpoint_async_needs_a_checkpoint_directory(tmp_path, capfd):
    plan = write_plan(tmp_path, "flags")
    assert main(["run", str(plan), "--checkpoint-async"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "planc: error: --checkpoint-async needs --checkpoint-dir"]

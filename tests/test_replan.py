"""planc run --on-failure replan (issue 39): a rank or a node killed with SIGKILL, and the
run goes on by itself on a layout of the devices left, from its newest checkpoint, with
--check passing after each switch; a second failure during the first recovery; a run
that cannot go on stops with the reason; SIGUSR1 grows a run back.

Every wait is for an event (a metrics record, a line of planc run's output, a rank's
process), under a generous deadline. The step a rank is killed at is drawn at random;
the seed is in every assertion's message."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planc.checkpoint import format as checkpoint
from planc.commands.replan_search import device_sets
from planc.data.metrics_file import read_metrics
from tests.conftest import ROOT
from tests.launched import DEADLINE_S, kill_all, ranks, session

pytest.importorskip("torch")

SGD = "train.optimizer=sgd(lr = 0.3, momentum = 0.9)"  # --check holds to 1e-5 (plans/demo.plan)
SEED = int(os.environ.get("PLANC_TEST_SEED", time.time_ns() % 10**6))


def test_device_sets_take_whole_nodes_or_part_of_one():
    assert device_sets(tuple(d for d in range(8) if d != 3), 4, 8) == \
        [(4, 5, 6, 7), (4, 5, 6), (4, 5), (4,)]
    assert device_sets((0, 1, 2, 3), 4, 8) == [(0, 1, 2, 3), (0, 1, 2), (0, 1), (0,)]
    assert device_sets(tuple(range(8)), 4, 8) == \
        [(0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3), (0, 1, 2), (0, 1), (0,)]
    # one node of 8: any part of it
    assert [len(s) for s in device_sets((0, 1, 2, 4, 5, 6, 7), 8, 8)] == [7, 6, 5, 4, 3, 2, 1]
    assert device_sets((0, 1, 2, 4, 5, 6, 7), 8, 4) == [(0, 1, 2, 4), (0, 1, 2), (0, 1), (0,)]
    assert device_sets((), 4, 8) == []


class Run:
    """``planc run`` in a session of its own, its standard error read line by line."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "planc", "run", *args], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append(None)  # the end
            self.changed.notify_all()

    def wait_for_line(self, text: str, count: int = 1) -> None:
        with self.changed:
            ok = self.changed.wait_for(
                lambda: sum(text in (line or "") for line in self.lines) >= count or
                None in self.lines, DEADLINE_S)
        assert ok and sum(text in (line or "") for line in self.lines) >= count, \
            (SEED, text, self.text())

    def text(self) -> str:
        return "".join(line for line in self.lines if line)

    def finish(self) -> int:
        """planc run's exit status, once it and every process of its session are gone
        (``left``: those still there after the deadline, killed then)."""
        try:
            code = self.process.wait(DEADLINE_S * 2)
            deadline = time.monotonic() + DEADLINE_S
            while session(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # the fork server and resource tracker see their ends
            self.left = session(self.process.pid)
        finally:
            kill_all(self.process)
        self.reader.join(DEADLINE_S)
        return code


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.endswith("}")]


def wait_for_steps(run: Run, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while len(records(metrics)) < steps:
        assert run.process.poll() is None and time.monotonic() < deadline, (SEED, run.text())
        time.sleep(0.02)


def wait_for_ranks(run: Run, build_part: str, count: int) -> dict[int, int]:
    """Rank -> pid of ``count`` ranks whose logs are under a path holding ``build_part``."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = {}
        for rank, pid in ranks(run.process.pid).items():
            try:
                if build_part in os.readlink(f"/proc/{pid}/fd/1"):
                    found[rank] = pid
            except OSError:
                continue
        if len(found) >= count:
            return found
        assert run.process.poll() is None, (SEED, run.text())
        time.sleep(0.02)
    raise AssertionError((SEED, "the ranks did not start", run.text()))


def start_tiny(tmp_path: Path, steps: int, *more: str) -> Run:
    return Run(str(ROOT / "plans" / "gpt-tiny.plan"), "-o", str(tmp_path / "b"),
               "--set", SGD, "--steps", str(steps), "--metrics", str(tmp_path / "m.jsonl"),
               "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
               "--on-failure", "replan", "--check", *more)


def assert_checkpoints_intact(directory: Path) -> None:
    steps = sorted(p for p in directory.iterdir() if p.name.startswith("step-"))
    assert steps
    for step in steps:
        checkpoint.find(step)  # every file against its sha256


def assert_same_as_resumed(tmp_path: Path, recovery: dict, replan: int, steps: int) -> None:
    """The losses after the switch equal those of the new layout's build run from the
    same checkpoint, by itself."""
    first = recovery["resumed_step"]
    again = tmp_path / f"again-{replan}.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "planc", "run", str(tmp_path / "b" / "replans" / str(replan)),
         "--resume", str(tmp_path / "ck" / f"step-{first:06d}"), "--steps", str(steps),
         "--metrics", str(again)], cwd=ROOT, capture_output=True, text=True,
        timeout=DEADLINE_S * 2)
    assert done.returncode == 0, (SEED, done.stderr)
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    ours = {r["step"]: r["loss"] for r in history if r["step"] >= first}
    theirs = {r["step"]: r["loss"] for r in records(again)}
    assert theirs and all(ours[s] == loss for s, loss in theirs.items()), (SEED, ours, theirs)


def test_a_rank_killed_at_a_random_step_and_the_run_goes_on_on_fewer_ranks(tmp_path):
    steps = 14
    at = random.Random(SEED).randrange(3, 8)  # records seen before the kill
    victim = random.Random(SEED + 1).randrange(8)
    run = start_tiny(tmp_path, steps)
    wait_for_steps(run, tmp_path / "m.jsonl", at)
    os.kill(ranks(run.process.pid)[victim], signal.SIGKILL)
    assert run.finish() == 0, (SEED, run.text())
    out = run.text()
    assert f"planc: rank {victim} killed by signal 9: taken as lost, with its device" in out
    assert f"planc: lost rank {victim} (device {victim}) of tp 2 pp 2 dp 2" in out, (SEED, out)
    assert "replanning onto the 7 devices left" in out
    assert "every loss and parameter matches" in out, (SEED, out)
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    assert [r["step"] for r in history] == list(range(steps))
    switched = [r for r in history if "recovery" in r]
    assert len(switched) == 1, (SEED, out)
    recovery = switched[0]["recovery"]
    assert recovery["event"] == "lost" and recovery["lost_ranks"] == [victim]
    assert recovery["from"] == "tp 2 pp 2 dp 2 | 1f1b m 4 | zero 1 stages file"
    # devices are taken by whole node: node 0 or 1 lost a device, the other is left
    assert recovery["ranks"] <= 4 and recovery["seconds_lost"] > 0
    assert switched[0]["step"] == recovery["resumed_step"]
    assert recovery["resumed_step"] % 2 == 0 and recovery["steps_redone"] >= 0
    assert run.left == []  # no process left behind
    assert_checkpoints_intact(tmp_path / "ck")
    assert_same_as_resumed(tmp_path, recovery, 1, steps)
    # planc report compares each build with the steps it ran
    for build, count in ((tmp_path / "b", recovery["resumed_step"]),
                         (tmp_path / "b" / "replans" / "1", steps - recovery["resumed_step"])):
        done = subprocess.run([sys.executable, "-m", "planc", "report", str(build), "--metrics",
                               str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "r.html"),
                               "--force"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert f"the {count} of its {steps} steps this build ran are compared" in done.stderr


def test_a_second_failure_during_the_first_recovery_is_handled_the_same_way(tmp_path):
    steps = 10
    run = start_tiny(tmp_path, steps)
    wait_for_steps(run, tmp_path / "m.jsonl", 3)
    os.kill(ranks(run.process.pid)[5], signal.SIGKILL)  # node 1 goes: on node 0 next
    run.wait_for_line("planc: replanned")
    second = wait_for_ranks(run, "/replans/1/", 1)
    victim = min(second)
    os.kill(second[victim], signal.SIGKILL)  # before the new layout's first step
    assert run.finish() == 0, (SEED, run.text())
    out = run.text()
    assert out.count("planc: replanned") == 2, (SEED, out)
    assert f"planc: lost rank {victim} (device {victim})" in out, (SEED, out)
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    assert [r["step"] for r in history] == list(range(steps))
    recovery = [r["recovery"] for r in history if "recovery" in r]
    assert recovery[-1]["lost_ranks"] == [victim], (SEED, out)
    assert "every loss and parameter matches" in out
    assert run.left == []
    assert_checkpoints_intact(tmp_path / "ck")
    assert_same_as_resumed(tmp_path, recovery[-1], 2, steps)


def test_a_whole_node_lost_and_the_run_grows_back_after_sigusr1(tmp_path):
    steps = 16
    run = start_tiny(tmp_path, steps)
    wait_for_steps(run, tmp_path / "m.jsonl", 3)
    pids = ranks(run.process.pid)
    for rank in (4, 5, 6, 7):  # node 1 (devices_per_node = 4)
        os.kill(pids[rank], signal.SIGKILL)
    run.wait_for_line("planc: replanned")
    assert "planc: lost ranks 4, 5, 6, 7 (devices 4, 5, 6, 7)" in run.text(), run.text()
    wait_for_ranks(run, "/replans/1/", 1)
    seen = len(records(tmp_path / "m.jsonl"))
    wait_for_steps(run, tmp_path / "m.jsonl", seen + 1)  # the smaller layout trains
    os.kill(run.process.pid, signal.SIGUSR1)
    assert run.finish() == 0, run.text()
    out = run.text()
    assert "growing back onto all 8" in out and "planc: grew back" in out, out
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    assert [r["step"] for r in history] == list(range(steps))
    lost, grew = [r["recovery"] for r in history if "recovery" in r]
    assert lost["lost_ranks"] == [4, 5, 6, 7] and lost["ranks"] <= 4
    assert grew["event"] == "grew" and grew["ranks"] > lost["ranks"], (grew, lost)
    assert run.left == []
    assert_checkpoints_intact(tmp_path / "ck")


def node_zero_lost(run: Run, metrics: Path, after: int) -> tuple[str, list[dict]]:
    """Ranks 0-3 (node 0 of two) killed once ``after`` steps are recorded; the run's
    output and metrics records once it has finished, which it must."""
    wait_for_steps(run, metrics, after)
    pids = ranks(run.process.pid)
    for rank in (0, 1, 2, 3):
        os.kill(pids[rank], signal.SIGKILL)
    assert run.finish() == 0, run.text()
    return run.text(), read_metrics(str(metrics)).records


@pytest.mark.parametrize("flags", [[], ["--checkpoint-async"]])
def test_a_node_lost_is_recovered_from_its_peers_memory(tmp_path, flags):
    """Both stages' writers are on node 0 (ranks 0 and 2): killing node 0 leaves their
    parts only in node 1's memory, a step newer than the file system's checkpoint."""
    shared = set(os.listdir("/dev/shm"))
    run = Run(str(ROOT / "plans" / "gpt-tiny.plan"), "-o", str(tmp_path / "b"), "--set", SGD,
              "--steps", "12", "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir",
              str(tmp_path / "ck"), "--checkpoint-every", "4", "--on-failure", "replan",
              "--check", "--checkpoint-peer-memory", *flags)
    # in the background, the copy after 5 steps may still be in flight when the 6th
    # step's record is written; the 7th step starts only once it is committed
    # (planc.runtime.checkpoint.peer_memory: each copy first waits for the one before)
    out, history = node_zero_lost(run, tmp_path / "m.jsonl", 7 if flags else 6)
    assert [r["step"] for r in history] == list(range(12))
    (recovery,) = [r["recovery"] for r in history if "recovery" in r]
    assert recovery["lost_ranks"] == [0, 1, 2, 3] and recovery["resumed_step"] > 4, out
    step = recovery["resumed_step"]
    assert f"planc: going on from step {step} (the copy in peer memory, newer than " \
           f"{tmp_path / 'ck'}'s step 4)" in out
    assert f"/assembled/step-{step:06d}" in out and "every loss and parameter matches" in out
    assert set(os.listdir("/dev/shm")) == shared  # the run's memory went with it
    assert run.left == []


def test_a_copy_in_peer_memory_needs_two_nodes(tmp_path, capsys):
    from planc.cli import main

    assert main(["run", str(ROOT / "plans" / "gpt-tiny.plan"), "-o", str(tmp_path / "b"),
                 "--set", "topology.nodes=1", "--set", "topology.devices_per_node=8",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-peer-memory"]) == 1
    assert capsys.readouterr().err.endswith(
        "planc: error: --checkpoint-peer-memory keeps each copy on another node, and the "
        "plan's 8 ranks are one node (topology devices_per_node 8); nothing was run\n")
    assert main(["run", str(ROOT / "plans" / "gpt-tiny.plan"), "-o", str(tmp_path / "b"),
                 "--checkpoint-peer-memory"]) == 2
    assert capsys.readouterr().err == "planc: error: --checkpoint-peer-memory needs " \
                                      "--checkpoint-dir\n"


CANNOT_GO_ON = """plan two {
  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 4 }
  mesh { dp = 2 }
  topology { device { memory = MEMORY } }
  shard { dp { zero = 3 } }
  schedule { microbatches = MICRO }
  train { steps = 40; optimizer = adamw(lr = 1e-3) }
}
"""


def test_a_run_that_cannot_go_on_stops_with_the_reason(tmp_path):
    from planc.estimate.memory import estimate
    from planc.lang import load_text

    # memory for ZeRO-3 on 2 devices, not for one device alone, even with a sequence a
    # microbatch and recomputation (AdamW: ZeRO-3 saves the moments' 8 bytes a parameter,
    # more than a unit held whole costs this small model)
    def need(dp: int, microbatches: int, recompute: str) -> float:
        text = CANNOT_GO_ON.replace("MEMORY", "80GB").replace("dp = 2", f"dp = {dp}")
        text = text.replace("MICRO", str(microbatches)).replace(
            "  train", f"  optimize {{ recompute = {recompute} }}\n  train")
        return estimate(load_text(text).plan).peak.total_bytes

    assert need(2, 2, "none") < need(1, 4, "full")
    memory = (need(2, 2, "none") + need(1, 4, "full")) / 2
    (tmp_path / "two.plan").write_text(CANNOT_GO_ON.replace(
        "MEMORY", f"{memory / 1e6:.3f}MB").replace("MICRO", "2"))
    run = Run(str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--metrics",
              str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"),
              "--checkpoint-every", "1", "--on-failure", "replan")
    wait_for_steps(run, tmp_path / "m.jsonl", 3)
    os.kill(ranks(run.process.pid)[1], signal.SIGKILL)
    assert run.finish() == 1, run.text()
    out = run.text()
    assert "planc: error: the run cannot go on: no layout of this model on 1 device or " \
           "fewer passes planc check and fits in the memory of a device" in out, out
    assert f"continue with --resume {tmp_path / 'ck'} once devices are back" in out
    assert run.left == []
    assert_checkpoints_intact(tmp_path / "ck")


def test_replan_needs_a_checkpoint_directory(tmp_path, capsys):
    from planc.cli import main

    assert main(["run", str(ROOT / "plans" / "gpt-tiny.plan"), "-o", str(tmp_path / "b"),
                 "--on-failure", "replan"]) == 2
    assert capsys.readouterr().err == (
        "planc: error: --on-failure replan needs --checkpoint-dir: a run goes on from its "
        "newest checkpoint (with --checkpoint-every N, at most N steps back)\n")
    assert not (tmp_path / "b").exists()


TWO = """plan two {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 4 }
  mesh { dp = 2 }
  train { steps = 40; optimizer = sgd(lr = 0.1, momentum = 0.9) }
}
"""


def test_a_run_resumed_from_an_older_step_never_goes_back_to_the_steps_it_left(tmp_path):
    """--resume ck/step-000002 while ck holds steps 4 and 6 of an earlier run: a failure
    goes back to this run's own checkpoints, or to step 2, never to the abandoned 6."""
    (tmp_path / "two.plan").write_text(TWO)
    from planc.cli import main

    assert main(["run", str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--steps", "6",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]) == 0
    run = Run(str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--steps", "12",
              "--resume", str(tmp_path / "ck" / "step-000002"), "--checkpoint-dir",
              str(tmp_path / "ck"), "--checkpoint-every", "4", "--metrics",
              str(tmp_path / "m.jsonl"), "--on-failure", "replan", "--check")
    wait_for_steps(run, tmp_path / "m.jsonl", 1)
    os.kill(ranks(run.process.pid)[1], signal.SIGKILL)
    assert run.finish() == 0, run.text()
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    assert [r["step"] for r in history] == list(range(2, 12))
    (recovery,) = [r["recovery"] for r in history if "recovery" in r]
    assert recovery["resumed_step"] in (2, 4), run.text()
    assert "every loss and parameter matches" in run.text()


def test_a_rank_stopped_is_lost_and_the_run_goes_on(tmp_path):
    (tmp_path / "two.plan").write_text(TWO)
    run = Run(str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--steps", "12",
              "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
              "--metrics", str(tmp_path / "m.jsonl"), "--on-failure", "replan", "--timeout",
              "5")  # not less: the start-up watch's too, which a busy machine could pass
    wait_for_steps(run, tmp_path / "m.jsonl", 3)
    os.kill(ranks(run.process.pid)[1], signal.SIGSTOP)
    assert run.finish() == 0, run.text()
    out = run.text()
    assert "planc: rank 1 was stopped (by SIGSTOP or a debugger)" in out, out
    assert "planc: lost rank 1 (device 1) of dp 2" in out, out
    history = read_metrics(str(tmp_path / "m.jsonl")).records
    assert [r["step"] for r in history] == list(range(12))
    (recovery,) = [r["recovery"] for r in history if "recovery" in r]
    assert recovery["lost_ranks"] == [1] and recovery["ranks"] == 1
    assert run.left == []


def test_a_build_compiled_with_set_is_refused_before_anything_runs(tmp_path, capsys):
    from planc.cli import main

    (tmp_path / "two.plan").write_text(TWO)
    assert main(["compile", str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--set",
                 "train.steps=5"]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / "b"), "--checkpoint-dir", str(tmp_path / "ck"),
                 "--on-failure", "replan"]) == 1
    assert capsys.readouterr().err.endswith(
        f"planc: error: --on-failure replan: the build {tmp_path / 'b'} is not what its plan "
        f"file {tmp_path / 'two.plan'} compiles to as it is now (the file changed, or the "
        f"build was compiled with --set); run the plan file, with its --set, instead; "
        f"nothing was run\n")
    assert not (tmp_path / "b" / "logs").exists() and not (tmp_path / "ck").exists()


def test_a_damaged_newest_checkpoint_leaves_the_one_before_it(tmp_path, capsys):
    """The run's newest checkpoint damaged (a model file cut short): a recovery goes on
    from the intact one before it, not from the step the run started from."""
    import types

    from planc.cli import main
    from planc.commands.replan import Segment, newest_checkpoint
    from planc.host.interrupts import Interrupts

    (tmp_path / "two.plan").write_text(TWO)
    assert main(["run", str(tmp_path / "two.plan"), "-o", str(tmp_path / "b"), "--steps", "3",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]) == 0
    model = next((tmp_path / "ck" / "step-000003").glob("model-*.safetensors"))
    model.write_bytes(model.read_bytes()[:100])
    capsys.readouterr()
    args = types.SimpleNamespace(checkpoint_dir=str(tmp_path / "ck"))
    segment = Segment(None, None, (), None, "")
    found = newest_checkpoint(args, segment, {}, Interrupts())
    assert found.directory == tmp_path / "ck" / "step-000002"
    assert capsys.readouterr().err.startswith(
        f"planc: warning: passing over {tmp_path}/ck/step-000003: ")


def test_the_progress_line_says_what_the_run_recovered_from():
    from planc.runtime.step_records import describe_recovery

    common = {"from": "tp 2 pp 2 dp 2", "to": "pp 2 dp 2", "ranks": 4, "resumed_step": 4,
              "steps_redone": 2, "seconds_lost": 6.25}
    assert describe_recovery({**common, "event": "lost", "lost_ranks": [5]}) == (
        "recovered: lost rank 5 of tp 2 pp 2 dp 2; now pp 2 dp 2 on 4 ranks from step 4, "
        "2 steps redone, 6.2 s from the failure to this step's end")
    # growing back loses no rank: the line said "lost ranks  of" before
    assert describe_recovery({**common, "event": "grew", "lost_ranks": []}) == (
        "grew back from tp 2 pp 2 dp 2; now pp 2 dp 2 on 4 ranks from step 4, 2 steps "
        "redone, 6.2 s from the failure to this step's end")

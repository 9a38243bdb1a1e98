"""RunOptions: what planc run hands its ranks, and what a rank started by torchrun parses
from its command line, are one value (planc.runtime.options)."""

from __future__ import annotations

import pytest

from planc.data.identity import Identity
from planc.runtime.options import RunOptions


def test_every_option_survives_the_workers_command_line():
    options = RunOptions(build="/b", backend="gloo", steps=3, timeout=60.5, metrics="/m.jsonl",
                         trace="/t.json", tensorboard="/tb", check=True, checkpoint_dir="/c",
                         checkpoint_every=2, resume="/c/step-000002", resume_verified=True,
                         data_identity=Identity(1, 2, 3, 4), force=True, unverified=True)
    assert RunOptions.parse(options.to_argv()) == options


def test_defaults_make_the_shortest_command_line():
    assert RunOptions("/b").to_argv() == ["/b", "--timeout", "120.0"]
    assert RunOptions.parse(["/b"]) == RunOptions("/b")
    # what planc run sets travels to every rank and back
    set_ = RunOptions("/b", checkpoint_dir="/c", checkpoint_async=True, straggler_margin=0.5)
    assert RunOptions.parse(set_.to_argv()) == set_


@pytest.mark.parametrize("argv, message", [
    (["/b", "--checkpoint-every", "0", "--checkpoint-dir", "/c"],
     "--checkpoint-every must be a number of steps from 1 to 10^12"),
    (["/b", "--steps", str(10**12 + 1)], "--steps must be a number of steps from 1 to 10^12"),
    (["/b", "--steps", "0"], "--steps must be a number of steps from 1 to 10^12"),
    (["/b", "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["/b", "--checkpoint-async"], "--checkpoint-async needs --checkpoint-dir"),
])
def test_a_wrong_worker_command_line_exits_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        RunOptions.parse(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"planc.runtime.worker: error: {message}"


@pytest.mark.parametrize("environment, message", [
    ({}, "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set: this is one rank of a "
         "run, to be started by torchrun (torchrun --nproc-per-node N -m ...); planc run and "
         "planc calibrate start their own ranks (docs/launching.md)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"},
     "MASTER_PORT is not set: this is one rank of a run, to be started by torchrun "
     "(torchrun --nproc-per-node N -m ...); planc run and planc calibrate start their own "
     "ranks (docs/launching.md)"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "RANK (2) must be at least 0 and below WORLD_SIZE (2)"),
    ({"RANK": "zero", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
     "RANK ('zero') and WORLD_SIZE ('2') must be whole numbers"),
    # planc's own launchers name their store instead of torchrun's address
    ({"RANK": "1", "WORLD_SIZE": "2", "PLANC_STORE": "/s"}, None),
])
def test_a_rank_started_without_a_launcher_says_so(environment, message, monkeypatch):
    """python -m planc.runtime.worker (or planc.runtime.calibrate) run by hand stops with
    what is missing, not a KeyError."""
    from planc.runtime.launcher.rendezvous import LAUNCHER_VARIABLES, STORE_VARIABLE, launched_rank

    for name in (*LAUNCHER_VARIABLES, STORE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert launched_rank() == (message if message else (1, 2))


def test_the_worker_and_calibrate_stop_before_anything_without_a_launcher(monkeypatch,
                                                                          capsys):
    pytest.importorskip("torch")
    from planc.runtime import calibrate, worker
    from planc.runtime.launcher.rendezvous import LAUNCHER_VARIABLES, STORE_VARIABLE

    for name in (*LAUNCHER_VARIABLES, STORE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    assert worker.main(["/no/such/build"]) == 2
    assert capsys.readouterr().err.startswith(
        "planc: error: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set")
    assert calibrate.main(["--devices-per-node", "2", "-o", "/no/such/x.json"]) == 2
    assert capsys.readouterr().err.startswith(
        "planc calibrate: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set")

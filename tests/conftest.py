"""Shared fixtures: paths of the repository, its example plans and a runner of the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"

# `make test` runs a test file per core (pytest-xdist), and planc run gives each rank the
# machine's cores over its ranks as intra-op threads (planc.runtime.launcher.launch): one
# thread a rank keeps two files' runs from oversubscribing the cores, and every run's sums
# in the order its expectations were written against. A setting of the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What every rank script ends with: it leaves as planc's own ranks do
# (planc.runtime.worker), through os._exit once its output is out, not through the
# interpreter's teardown, which a C++ thread still running aborts now and then
# ("terminate called without an active exception", SIGABRT: seen on 2026-12-04 in a
# fresh clone, tests/test_recompute_norms.py's one-rank llama, after its JSON was out).
# A script that exits or fails before it leaves as it did.
LEAVE = ("\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n"
         "_os._exit(0)\n")


def script_on_ranks(script: str, tmp_path: Path, ranks: int = 2, *args: str
                    ) -> list[tuple[str, str]]:
    """``script`` (Python source) run by ``ranks`` processes that join one gloo group
    through a file store: its argv is the rank, the store's path, then ``args``. Each
    rank's (stdout, stderr), once all have exited."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", script + LEAVE, str(rank),
                                   str(tmp_path / "store"), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for rank in range(ranks)]
    return [process.communicate(timeout=120) for process in processes]


ONE_RANK_PLAN = """plan one {
  model gpt { layers = 2; hidden = 64; heads = 4; vocab = 256; seq = 32; batch = 4 }
  mesh { }
  train { steps = 2; optimizer = adamw(lr = 1e-3); seed = 0 }
}
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process holds now, as the system hands one out: a
    rendezvous of one test never meets another's, whatever else runs on the machine."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def run_one_rank(script: str, tmp_path: Path, *args: str, threads: int = 1,
                 plan_text: str = ONE_RANK_PLAN, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """``script`` (Python source) run as one rank of ``plan_text``'s build (a 1-rank
    plan), with the environment torchrun gives a rank (and ``env``) and ``threads``
    intra-op threads: its argv is the build directory, then ``args``."""
    return run_ranks(script, tmp_path, *args, threads=threads, plan_text=plan_text,
                     env=env)[0]


def run_ranks(script: str, tmp_path: Path, *args: str, world: int = 1, threads: int = 1,
              plan_text: str = ONE_RANK_PLAN, env: dict[str, str] | None = None
              ) -> list[subprocess.CompletedProcess]:
    """``script`` run as every rank of a ``world``-rank build of ``plan_text`` at once, as
    :func:`run_one_rank` runs one; each rank's completed process, by rank."""
    build, plan = tmp_path / "build", tmp_path / "one.plan"
    plan.write_text(plan_text)
    compiled = subprocess.run([sys.executable, "-m", "planc", "compile", str(plan), "-o",
                               str(build)], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    port = free_port()
    started = []
    for rank in range(world):
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **(env or {})}
        started.append(subprocess.Popen([sys.executable, "-c", script + LEAVE, str(build),
                                         *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, cwd=ROOT, env=environment))
    done = []
    for process in started:
        out, err = process.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def resigned_plan(build: Path, change) -> Path:
    """Edit a build's plan.json with ``change`` and sign it again (build.json's and
    graph.json's plan_sha256, a checksum), as an attacker or an older planc would have
    written it; its path."""
    from planc.build.directory import _fingerprint

    path = build / "plan.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    fingerprint = _fingerprint(data)
    for name, keys in (("build.json", ("plan_sha256",)), ("graph.json", ("graph", "plan_sha256"))):
        document = json.loads((build / name).read_text())
        holder = document
        for key in keys[:-1]:
            holder = holder[key]
        holder[keys[-1]] = fingerprint
        (build / name).write_text(json.dumps(document))
    return path


def one_rank_printed(done: subprocess.CompletedProcess) -> dict:
    """The JSON object the last line of a rank script's output prints, once it succeeded."""
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A plan with exactly one error, the one of the language reference: tp = 8, heads = 12.
BAD_TP = """\
# tp does not divide heads
plan bad {
  model gpt {
    layers = 2
    hidden = 96
    heads  = 12
    vocab  = 256
    seq    = 32
    batch  = 8
  }
  mesh {
    tp = 8
  }
}
"""

# The files that take longest, longest first: `make test` (pytest-xdist, --dist loadfile
# --no-loadscope-reorder) hands files to its workers in collection order, so a long file
# collected last runs alone at the end while the other workers wait; longest first, the
# end is a tail of short files. The order follows the seconds of each file in a whole
# `make test` (2 workers on 2 cores, 2026-12-02, bench/suite_cpu.py): test_limits_compiled
# (every command at the limits, about 90 s), test_replan, test_moe_overlap, test_runtime
# (the --check matrix), then the files of 20 to 35 s. Every other file follows, the most
# tests first (pytest-xdist's own order).
LONGEST_FIRST = (
    "test_limits_compiled.py", "test_replan.py", "test_moe_overlap.py", "test_runtime.py",
    "test_compile_cli.py", "test_simulate.py", "test_damaged_programs.py", "test_signals.py",
    "test_checkpoint.py", "test_launcher.py", "test_deepseek_mla.py", "test_llama.py",
    "test_moe_balance_bias.py", "test_damaged_builds.py", "test_routes.py",
    "test_run_metrics.py", "test_runtime_data_and_failures.py", "test_damaged_checkpoints.py",
    "test_lower.py", "test_fuzz.py", "test_hostile.py", "test_moe.py", "test_fp8.py",
    "test_tune.py", "test_resilience.py", "test_untrusted_builds.py", "test_simulate_moe.py",
    "test_cli.py", "test_data.py", "test_peer_data.py", "test_output_paths.py",
    "test_moe_export.py", "test_outputs.py")


def pytest_collection_modifyitems(items: list) -> None:
    """Files in the order of :data:`LONGEST_FIRST`, then by number of tests; the tests of
    a file keep their order (a module's fixtures and its last tests rely on it)."""
    counts: dict = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -counts[item.path],
                                 str(item.path)))


@pytest.fixture
def run_planc():
    """Run the real ``planc`` command in a subprocess; returns CompletedProcess."""

    def run(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
        return subprocess.run([sys.executable, "-m", "planc", *map(str, args)],
                              capture_output=True, text=True, env=env, cwd=cwd or ROOT,
                              timeout=timeout)

    return run


# Root reads any file whatever its mode (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so that a
# test run as root proves nothing by chmod alone: as root, the child drops both from its
# capability bounding set before exec, and after exec root holds only what that set
# allows, so file permissions apply to it as to anyone else.

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2
DROP_FAILED = 111  # the child's status when prctl refused


def drop_file_capabilities() -> None:  # preexec_fn: in the child, before exec
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            os._exit(DROP_FAILED)


def unprivileged(argv: list[str], timeout: float = 60):
    import subprocess

    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          preexec_fn=drop_file_capabilities if os.geteuid() == 0 else None)


@pytest.fixture(scope="session")
def permissions_apply(tmp_path_factory) -> None:
    """Skip unless a child started as the tests start planc is refused a mode-000
    directory (EACCES); checked, not assumed."""
    import sys

    if not hasattr(os, "geteuid"):
        pytest.skip("needs POSIX file permissions")
    locked = tmp_path_factory.mktemp("probe") / "locked"
    locked.mkdir()
    (locked / "file").write_text("x")
    locked.chmod(0)
    try:
        probe = unprivileged([sys.executable, "-c", "import errno, os, sys\n"
                               f"try:\n    os.listdir({str(locked)!r})\n"
                               "except PermissionError as exc:\n"
                               "    sys.exit(0 if exc.errno == errno.EACCES else 3)\n"
                               "sys.exit(4)"])
    except OSError as exc:  # no ctypes prctl, or no fork and exec
        pytest.skip(f"cannot start a child without the capabilities to read any file: {exc}")
    finally:
        locked.chmod(0o755)
    if probe.returncode == DROP_FAILED:
        pytest.skip("running as root, and prctl(PR_CAPBSET_DROP) was refused (no "
                    "CAP_SETPCAP?): root reads every file, so mode 000 cannot be tested")
    if probe.returncode != 0:
        pytest.skip(f"a mode-000 directory is readable here (status {probe.returncode}: "
                    f"{probe.stderr[-300:]}); file permissions cannot be tested")


def counting(*ops):
    """A torch dispatch mode that counts, while it is entered, the calls of ``ops``
    (aten overloads such as ``torch.ops.aten.mm.default``): what a backward computes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in ops
            return func(*args, **(kwargs or {}))

    return Counting()


def most_alive(shape, run) -> int:
    """The most tensors of ``shape`` with storage of their own (not views of a larger
    tensor) that ``run()`` made and held at once: the storage a backward's temporaries
    take at its peak."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Alive(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made, self.most = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == shape and \
                    out.untyped_storage().nbytes() == out.numel() * out.element_size():
                self.made.append(weakref.ref(out))
            self.most = max(self.most, sum(ref() is not None for ref in self.made))
            return out

    with Alive() as alive:
        run()
    return alive.most


def checkpoint_tensors(directory: Path) -> dict:
    """Every tensor of the latest checkpoint in ``directory``, by its name."""
    from safetensors import safe_open

    step = directory / (directory / "latest").read_text().strip()
    index = json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, file in index.items():
        with safe_open(str(step / file), framework="pt") as handle:
            tensors[name] = handle.get_tensor(name)
    return tensors


def trained_one_step(text: str, tmp_path: Path, capfd) -> tuple[float, dict]:
    """``planc run`` of plan ``text`` checkpointed every step: its first step's loss and
    the latest checkpoint's tensors (after one SGD step of a large learning rate, they
    give the gradients: (initial - final) / lr)."""
    from planc.cli import main

    source, metrics, checkpoints = tmp_path / "one.plan", tmp_path / "m.jsonl", \
        tmp_path / "ckpt"
    source.write_text(text)
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics",
                   str(metrics), "--checkpoint-dir", str(checkpoints), "--checkpoint-every",
                   "1", "--timeout", "60"])
    assert status == 0, capfd.readouterr().err
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    return loss, checkpoint_tensors(checkpoints)


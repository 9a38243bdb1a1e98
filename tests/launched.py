"""Real ``planc run`` processes for the launcher's tests: a build whose ranks wait
forever once they train, starting it in a session of its own, and finding the processes
of a run from /proc (tests/test_launcher.py, test_signals.py, test_private_rendezvous.py).

Every wait here is for an event (a rank's process appearing, the file a rank writes when
it starts its first step), under a generous deadline, so that the tests hold on a
machine busy with other work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from planc.cli import main
from tests.conftest import ROOT

STUCK_PLAN = """plan stuck {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 4 }
  mesh { MESH }
  schedule { microbatches = 2 }
  train { steps = 2 }
}
"""
DEADLINE_S = 120.0


def stuck_build(directory: Path, mesh: str = "pp = 2", data: str | None = None) -> Path:
    """Compile a two-stage plan into ``directory/b`` and take every send out of stage 0's
    program: its ranks wait for activations that never come, in the first step. ``data``:
    a token file to train on instead of synthetic data."""
    text = STUCK_PLAN.replace("MESH", mesh)
    if data is not None:
        text = text.replace("steps = 2", f'steps = 2; data = "{data}"')
    (directory / "stuck.plan").write_text(text)
    assert main(["compile", str(directory / "stuck.plan"), "-o", str(directory / "b")]) == 0
    path = directory / "b" / "programs" / "stage0.json"
    data = json.loads(path.read_text())
    data["blocks"] = {name: [x for x in block if x["op"] != "send"]
                      for name, block in data["blocks"].items()}
    path.write_text(json.dumps(data))
    return directory / "b"


def start(build: Path, *args: str, env: dict | None = None,
          prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """``planc run BUILD --no-verify ARGS`` in a session of its own (its pid is the
    session's id, which every process of the run shares)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "planc", "run", str(build),
                             "--no-verify", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})}, preexec_fn=_as_in_a_terminal)


def _as_in_a_terminal() -> None:
    """SIGINT at its default in the run, as for a command typed at a terminal: a suite
    started in the background of a shell (``make test &``) inherits SIGINT ignored, an
    ignored disposition survives exec, and Python then leaves it ignored until planc's
    first line installs a handler, so a Ctrl-C sent before that line would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def state(pid: int) -> str | None:
    """The kernel's state letter of a process (Z: a zombie), or None once it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def session(sid: int) -> list[int]:
    """The live processes of session ``sid``: every process of a run started by
    :func:`start`, the fork server and the resource tracker included."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(entry)
        if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(entry)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def ranks(pid: int) -> dict[int, int]:
    """Rank -> process id, for the rank processes under the launcher ``pid``: those whose
    standard output is a rank's log file (BUILD/logs/RUN/RANK/stdout.log) and whose parent's
    is not: a process a rank starts shares its output, and a signal meant for the rank
    must not go to it."""
    def output(process: int) -> str | None:
        try:
            return os.readlink(f"/proc/{process}/fd/1")
        except OSError:
            return None

    found = {}
    for child in descendants(pid):
        target = output(child)
        fields = _stat(child)
        if target is None or not target.endswith("/stdout.log") or fields is None or \
                output(int(fields[1])) == target:
            continue
        found[int(Path(target).parent.name)] = child
    return found


def _training(pid: int) -> bool:
    try:
        log_dir = Path(os.readlink(f"/proc/{pid}/fd/1")).parent
    except OSError:
        return False
    return (log_dir / "training").exists()


def wait_for_training(process: subprocess.Popen, count: int = 2) -> dict[int, int]:
    """Rank -> pid once ``count`` ranks have started their first step (each writes
    ``training`` into its log directory then), where the stuck build makes them wait."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = ranks(process.pid)
        if len(found) >= count and all(_training(pid) for pid in found.values()):
            return found
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError("the ranks did not start training")


def kill_all(process: subprocess.Popen) -> None:
    """SIGKILL every process of the run (its session) and reap the launcher."""
    for pid in [*session(process.pid), process.pid]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.wait()


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on (/proc/net/tcp)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, family, width in (("/proc/net/tcp", socket.AF_INET, 8),
                                 ("/proc/net/tcp6", socket.AF_INET6, 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word of the address in host order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                found.append((socket.inet_ntop(family, words), int(port, 16)))
    return found

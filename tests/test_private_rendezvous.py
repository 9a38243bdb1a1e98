"""A run that no other user can reach (issue 20): planc run's store is a file in a
directory only its user may enter, gone when the run ends, and gloo listens on loopback
whatever this machine's hostname resolves to.

Each test runs the real ``planc run`` (gloo, 2 ranks) on a build whose stage 0 never
sends its activations, so both ranks wait in the step, alive, until stopped; the build
lies in a directory every user may enter, so that only the run's own permissions keep
another user out. Becoming another user needs root: the tests skip without it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torch")

# imported here, before any child becomes nobody: nobody may not read this Python's
# standard library (under /root)
import torch.distributed as dist  # noqa: E402

from planc.runtime.launcher.rendezvous import STORE_DIRECTORY  # noqa: E402
from tests.launched import (descendants, listening, start, stuck_build,  # noqa: E402
                            wait_for_training)

pytestmark = pytest.mark.slow

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test becomes another user (nobody) to try the run")


@pytest.fixture(scope="module")
def stuck():
    """A build that every user may read, whose ranks wait forever."""
    directory = Path(tempfile.mkdtemp(prefix="planc-shared-"))
    directory.chmod(0o755)  # pytest's own temporary directories are the user's only
    try:
        yield stuck_build(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _start(build: Path, prefix: list[str] = ()):
    return start(build, "--timeout", "600", prefix=tuple(prefix))


def _stop(process: subprocess.Popen) -> str:
    """Ctrl-C for the launcher (it stops every rank and cleans up); its error output."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=60)[1]
    finally:
        for pid in [*descendants(process.pid), process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _as_nobody(attempt, *args) -> dict:
    """``attempt(*args)`` in a child that became the user nobody, as JSON. The child is
    forked, not started: nobody may not run this machine's Python (under /root)."""
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write_end, json.dumps(attempt(*args)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)


def _try_stores(ports: list[int], files: list[str], run_dir: str) -> dict:
    """As another user: set and get a key of each TCPStore port, read and append to each
    store file, and list the run's log directory. Each outcome: the value got, or the
    error's errno (files) or text (TCP)."""
    out = {"tcp": {}, "read": {}, "append": {}, "list": {}}
    for port in ports:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=timedelta(seconds=5))
            client.set("planc-intruder", "was here")
            out["tcp"][str(port)] = client.get("planc-intruder").decode()
        except Exception as exc:  # torch raises RuntimeError or DistStoreError
            out["tcp"][str(port)] = f"refused: {type(exc).__name__}"
    for path in files:
        for mode, key in (("rb", "read"), ("ab", "append")):
            try:
                with open(path, mode):
                    out[key][path] = "opened"
            except OSError as exc:
                out[key][path] = errno.errorcode[exc.errno]
        try:
            out["list"][os.path.dirname(path)] = sorted(os.listdir(os.path.dirname(path)))
        except OSError as exc:
            out["list"][os.path.dirname(path)] = errno.errorcode[exc.errno]
    out["run_dir"] = sorted(os.listdir(run_dir))
    return out


def test_another_user_can_neither_read_nor_write_a_live_runs_store(stuck):
    _needs_root()
    process = _start(stuck)
    try:
        wait_for_training(process)
        # the run's store: whatever the launcher itself listens on (a TCPStore server),
        # and any store file in its log directory
        ports = [port for _, port in listening([process.pid])]
        run_dirs = [p for p in (stuck / "logs").iterdir() if p.is_dir()]
        assert len(run_dirs) == 1
        files = [str(p) for p in run_dirs[0].glob(f"{STORE_DIRECTORY}/*")]
        assert ports or files, "the run has a store somewhere"
        seen = _as_nobody(_try_stores, ports, files, str(run_dirs[0]))
        mode = (run_dirs[0] / STORE_DIRECTORY).stat().st_mode & 0o777 if files else None
    finally:
        _stop(process)
    assert seen["tcp"] == {}, f"another user reached the run's TCPStore: {seen['tcp']}"
    assert files == [str(run_dirs[0] / STORE_DIRECTORY / "store")]
    assert seen["read"] == seen["append"] == {files[0]: "EACCES"}
    assert seen["list"] == {str(run_dirs[0] / STORE_DIRECTORY): "EACCES"}
    assert STORE_DIRECTORY in seen["run_dir"]  # the logs are visible; only the store is not
    assert mode == 0o700
    # the launcher removed the store when Ctrl-C ended the run
    assert not (run_dirs[0] / STORE_DIRECTORY).exists()


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine on an interface other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("127."):
                return address
    return None


HOSTNAME_THEN_EXEC = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
                      "os.execv(sys.argv[2], sys.argv[2:])")


def test_gloo_listens_on_loopback_even_where_the_hostname_names_another_address(stuck):
    """gloo binds to the address the hostname resolves to unless GLOO_SOCKET_IFNAME names
    an interface: here the hostname is this machine's own non-loopback address (in a UTS
    namespace of the run's own)."""
    _needs_root()
    address = _non_loopback_address()
    if address is None or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs unshare, nsenter and a network interface besides loopback")
    process = _start(stuck, ["unshare", "--uts", sys.executable, "-c", HOSTNAME_THEN_EXEC,
                             address])
    try:
        wait_for_training(process)
        addresses = {a for a, _ in listening([process.pid, *descendants(process.pid)])}
        hostname = subprocess.run(["nsenter", "-t", str(process.pid), "-u", "hostname"],
                                  capture_output=True, text=True).stdout.strip()
    finally:
        _stop(process)
    assert hostname == address  # so gloo, left to itself, would listen on it
    assert addresses == {"127.0.0.1"}

"""A build directory written whole or not at all: a Ctrl-C while compile writes its
staging directory, or between the renames that swap it in, leaves the earlier build as
it was and nothing else; -o naming a symbolic link writes the link's target.

The signal is real and comes at an exact moment: an audit hook (PEP 578), loaded by the
planc process from a sitecustomize on its PYTHONPATH, sends SIGINT to its own process
when compile first opens a file in its staging directory, or renames that directory
into place, and planc's handler raises inside the hook, which aborts that operation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PLANS, ROOT

INTERRUPT_AT = """
import os, signal, sys

MOMENT = {moment!r}


def _interrupt(event, args):
    if getattr(_interrupt, "fired", False):
        return
    if MOMENT == "write" and event == "open" and isinstance(args[0], (str, os.PathLike)):
        hit = ".tmp-" in os.fspath(args[0]) and "w" in str(args[1])
    elif MOMENT == "rename" and event == "os.rename":
        hit = ".tmp-" in os.fspath(args[0])
    else:
        return
    if hit:
        _interrupt.fired = True
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here, inside the hook
            pass


sys.addaudithook(_interrupt)
"""


def _compile_interrupted(tmp_path: Path, moment: str, output: Path) -> subprocess.CompletedProcess:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INTERRUPT_AT.format(moment=moment))
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "planc", "compile", str(PLANS / "gpt-tiny.plan"),
                           "-o", str(output), "--force"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def _entries(directory: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("moment", ["write", "rename"])
def test_a_ctrl_c_while_compile_writes_leaves_the_earlier_build_and_nothing_else(moment,
                                                                                tmp_path):
    builds = tmp_path / "builds"
    builds.mkdir()
    out = builds / "b"
    done = subprocess.run([sys.executable, "-m", "planc", "compile",
                           str(PLANS / "llama-tiny.plan"), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    (out / "notes.txt").write_text("mine\n")  # carried into a new build, kept by an old one
    before = _entries(builds)
    done = _compile_interrupted(tmp_path, moment, out)
    assert (done.returncode, done.stderr.splitlines()[-1]) == \
        (130, "planc: interrupted by signal 2"), done.stderr
    assert "Traceback" not in done.stderr
    # no staging (.b.tmp-*) or swapped-out (.b.old-*) directory left beside it
    assert sorted(os.listdir(builds)) == ["b"]
    assert _entries(builds) == before


def test_compile_into_a_symbolic_link_writes_its_target_and_keeps_the_link(tmp_path):
    """The link was renamed away (and left as .link.old-*) and a directory took its
    name, so the build it pointed at kept the old build."""
    real, link = tmp_path / "real", tmp_path / "link"
    for plan, into in (("llama-tiny.plan", real), ("gpt-tiny.plan", link)):
        if into == link:
            link.symlink_to("real")
        done = subprocess.run([sys.executable, "-m", "planc", "compile", str(PLANS / plan),
                               "-o", str(into), "--force"], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        (real / "notes.txt").write_text("mine\n")
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert link.is_symlink() and os.readlink(link) == "real"
    assert '"plan": "gpt_tiny"' in (real / "build.json").read_text()
    assert (real / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("inside", [".", "programs"])
def test_compile_into_the_directory_it_runs_in_or_one_holding_it_is_refused(inside, tmp_path):
    """From inside the build's programs/, -o .. said only "Device or resource busy"."""
    build = tmp_path / "b"
    done = subprocess.run([sys.executable, "-m", "planc", "compile",
                           str(PLANS / "gpt-tiny.plan"), "-o", str(build)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    before = _entries(build)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "planc", "compile",
                           str(PLANS / "gpt-tiny.plan"), "-o",
                           "." if inside == "." else "..", "--force"],
                          capture_output=True, text=True, cwd=build / inside, env=env,
                          timeout=300)
    assert (done.returncode, done.stderr) == (1, (
        "planc: error: planc replaces the whole build directory, so it cannot be the current "
        "directory or hold it; name a subdirectory, such as -o build/NAME\n"))
    assert _entries(build) == before and sorted(os.listdir(tmp_path)) == ["b"]

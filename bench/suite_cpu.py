"""Benchmark: where the suite's CPU goes, per test and per test file.

`make test` on a 2-core machine is bound by CPU, not by waiting (issue 36), so its time
is cut where its CPU-seconds are. A test's own clock misses most of them: they are spent
in the processes it starts (``planc`` commands, fork servers, ranks, forked corpus
inputs). This pytest plugin puts each pytest process (each xdist worker) in a cgroup of
its own, which every process it starts inherits, and reads the group's CPU counter around
every test. Root only (cgroup v1 ``cpuacct`` or cgroup v2).

    make test PYTEST_ARGS="-p suite_cpu" PYTHONPATH=bench SUITE_CPU=build/suite-cpu
    .venv/bin/python bench/suite_cpu.py build/suite-cpu [--files 40] [--tests 25]

The first writes one JSON line per test (wall and CPU seconds) into ``SUITE_CPU``
(default ``build/suite-cpu``); the second prints the totals, the files by CPU, and the
tests by CPU. Run on a quiet machine: another job's load inflates every figure.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup")

_group: Path | None = None


def _join_group() -> Path:
    """A new cgroup holding this process (and what it starts); its CPU counter's file."""
    name = f"planc-suite-cpu-{os.getpid()}"
    if (V1 / "cpuacct.usage").exists():
        group, counter = V1 / name, "cpuacct.usage"
    elif (V2 / "cgroup.controllers").exists():
        group, counter = V2 / name, "cpu.stat"
    else:
        raise RuntimeError("suite_cpu: no cgroup CPU counter on this machine")
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group / counter


def _cpu_seconds(counter: Path) -> float:
    text = counter.read_text()
    if counter.name == "cpuacct.usage":
        return int(text) / 1e9  # nanoseconds
    fields = dict(line.split() for line in text.splitlines())
    return int(fields["usage_usec"]) / 1e6


def pytest_configure(config) -> None:
    global _group
    _group = _join_group()


def pytest_unconfigure(config) -> None:
    """Back to the parent group, and the group removed (it must be empty for that; a
    process still running in it keeps it, harmlessly)."""
    if _group is None:
        return
    group = _group.parent
    try:
        (group.parent / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
    except OSError:
        pass


def _out_dir() -> Path:
    return Path(os.environ.get("SUITE_CPU", "build/suite-cpu"))


def _record(nodeid: str, wall: float, cpu: float) -> None:
    out = _out_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"test": nodeid, "wall": round(wall, 3), "cpu": round(cpu, 3)})
                + "\n")


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        wall, cpu = time.perf_counter(), _cpu_seconds(_group)
        yield
        _record(item.nodeid, time.perf_counter() - wall, _cpu_seconds(_group) - cpu)
except ImportError:  # the report below needs no pytest
    pass


def report(directory: Path, files: int, tests: int) -> None:
    rows = [json.loads(line) for path in sorted(directory.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"suite_cpu: no records in {directory}")
    print(f"{len(rows)} tests: wall {sum(r['wall'] for r in rows):.1f} s, "
          f"CPU {sum(r['cpu'] for r in rows):.1f} s (summed over the workers)")
    by_file: dict[str, list[float]] = {}
    for r in rows:
        totals = by_file.setdefault(r["test"].split("::")[0], [0.0, 0.0, 0])
        totals[0] += r["wall"]
        totals[1] += r["cpu"]
        totals[2] += 1
    print(f"\n{'wall s':>8} {'CPU s':>8} {'tests':>5}  file")
    for name, (wall, cpu, count) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:files]:
        print(f"{wall:8.1f} {cpu:8.1f} {count:5d}  {name}")
    print(f"\n{'wall s':>8} {'CPU s':>8}  test")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:tests]:
        print(f"{r['wall']:8.1f} {r['cpu']:8.1f}  {r['test'][:140]}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The suite's CPU per file and per test.")
    parser.add_argument("directory", type=Path, nargs="?", default=_out_dir())
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--tests", type=int, default=25)
    options = parser.parse_args()
    report(options.directory, options.files, options.tests)

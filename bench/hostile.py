"""Hostile inputs against the real planc command line, by the thousand, with a report.

Runs every deliberate extreme of tests/hostile_inputs.py under check, check --error-format
json and compile; every example and invalid plan as it is; ``--count`` seeded mutants of
the example and invalid plans; and a sample of all of these again through the real
``planc`` console script (a fresh interpreter each). Each input runs in a child process
of its own under a wall-clock limit and an address-space limit, ``--workers`` at a time.

The report: inputs, exit statuses and failures per kind; the slowest input and its time;
the peak memory (maximum resident set of one run) and its input; and every failure, with
the problem and a reproducer saved under ``--out`` (default build/hostile/): the input's
files and a ``repro.sh`` that recreates the special ones (named pipes, sparse files,
symbolic-link loops) and runs the command. One failure of each distinct kind is shrunk
to a smaller input that fails the same way (``NAME-min/``), when it is a plan file of at
most 64 KB that did not time out. ``report.json`` holds everything. Exit status: 0 when
nothing failed, 1 otherwise.

    .venv/bin/python bench/hostile.py [--count N] [--seed S] [--workers 2]
                                      [--time-limit 20] [--memory-limit-gib 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import hostile_inputs as hostile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHRINK_LIMIT = 64 * 1024  # bytes: larger failing inputs are reported as they are


def corpus(count: int, seed: int, commands: str, exec_every: int) -> list[hostile.Case]:
    cases = hostile.extremes(commands, tier="bench") + hostile.originals() + \
        hostile.mutants(count, seed)
    # A sample run again through the real console script: the same verdicts are expected.
    sample = [dataclasses.replace(c, kind="exec", name=f"{c.name}-exec", mode="exec")
              for c in cases[::exec_every] if c.kind != "limits"]
    return cases + sample


def _heavy_first(cases: list[hostile.Case]) -> list[int]:
    """An order that starts the inputs likely to take longest first, so that they overlap
    the many quick ones instead of trailing at the end."""
    heavy = {"limits": 0, "big-file": 1, "plan-file": 2, "topology-path": 3}
    return sorted(range(len(cases)), key=lambda i: (heavy.get(cases[i].kind, 9),
                                                    -len(cases[i].plan or b"")))


def run(cases: list[hostile.Case], workers: int, time_limit: float, memory_limit: int,
        work: str, quiet: bool = False) -> list[hostile.Result]:
    """Materialise each case just before its run, in batches, and delete it after."""
    order = _heavy_first(cases)
    results: list[hostile.Result | None] = [None] * len(cases)
    started = time.monotonic()
    batch = 200
    failed = 0
    for first in range(0, len(order), batch):
        indices = order[first:first + batch]
        jobs = []
        for i in indices:
            directory = os.path.join(work, f"{i:06d}")
            hostile.materialize(cases[i], directory)
            jobs.append(hostile.job_for(cases[i], directory, time_limit))
        # A fresh driver per batch: what a child's resident set counts of its parent
        # (the pages it shares from the fork) stays the driver's ~40 MB of planc.
        for i, result in zip(indices, hostile.run_in_subprocess(
                jobs, os.path.join(work, "driver"), workers, memory_limit,
                timeout=len(jobs) * time_limit + 300)):
            results[i] = result
            failed += bool(hostile.problems(cases[i], result))
            shutil.rmtree(os.path.join(work, f"{i:06d}"), ignore_errors=True)
        if not quiet:
            done = min(first + batch, len(order))
            print(f"  {done:6,d} / {len(order):,d} inputs, {failed:,d} failing, "
                  f"{time.monotonic() - started:6.1f} s", file=sys.stderr, flush=True)
    return results  # type: ignore[return-value]


# --- shrinking one failure -------------------------------------------------------------------


def _pieces(data: bytes, level: str) -> list[bytes]:
    if level == "lines":
        return data.splitlines(keepends=True)
    text = data.decode("utf-8", errors="surrogateescape")
    return [t.encode("utf-8", errors="surrogateescape") for t in hostile.TOKEN.findall(text)]


def shrink(case: hostile.Case, target: str, args, work: str, budget: int = 150) -> hostile.Case:
    """A smaller plan that still fails with signature ``target``: chunks of lines, then of
    tokens, removed while the failure stays (ddmin-like, at most ``budget`` runs)."""
    tries = 0

    def fails(data: bytes) -> bool:
        nonlocal tries
        tries += 1
        candidate = dataclasses.replace(case, plan=data)
        directory = os.path.join(work, "shrink")
        shutil.rmtree(directory, ignore_errors=True)
        hostile.materialize(candidate, directory)
        [result] = hostile.run_jobs([hostile.job_for(candidate, directory, args.time_limit)],
                                    os.path.join(work, "io"), 1, args.memory_limit)
        found = hostile.problems(candidate, result)
        return bool(found) and hostile.signature(candidate, found) == target

    data = case.plan
    for level in ("lines", "tokens"):
        pieces = _pieces(data, level)
        chunks = 2
        while len(pieces) >= 2 and tries < budget:
            size = max(len(pieces) // chunks, 1)
            for start in range(0, len(pieces), size):
                candidate = pieces[:start] + pieces[start + size:]
                if tries >= budget:
                    break
                if fails(b"".join(candidate)):
                    pieces, chunks = candidate, max(chunks - 1, 2)
                    break
            else:
                if size == 1:
                    break
                chunks = min(chunks * 2, len(pieces))
        data = b"".join(pieces)
    return dataclasses.replace(case, plan=data, name=f"{case.name}-min",
                               note=f"shrunk from {len(case.plan):,d} bytes ({case.name}) in "
                               f"{tries} runs")


# --- the report ----------------------------------------------------------------------------


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._^+-]", "_", name)[:150]


def report(cases, results, args, out: Path, seconds: float) -> int:
    summary = hostile.summarize(cases, results)
    by_kind: dict[str, Counter] = summary["by_kind"]
    peak: dict[str, tuple[float, int]] = {}
    for case, result in zip(cases, results):
        slow, rss = peak.get(case.kind, (0.0, 0))
        peak[case.kind] = (max(slow, result.seconds), max(rss, result.maxrss_kb))
    print()
    print(f"hostile inputs: {len(cases):,d} runs in {seconds:.0f} s, {args.workers} at a time, "
          f"limits {args.time_limit:g} s and {args.memory_limit_gib:g} GiB each "
          f"(mutants: {args.count:,d}, seed {args.seed})")
    print()
    header = (f"{'kind':18} {'inputs':>7} {'exit 0':>7} {'exit 1':>7} {'exit 2':>7} "
              f"{'killed':>7} {'failed':>7} {'slowest':>9} {'peak RSS':>9}")
    print(header)
    print("-" * len(header))
    total = Counter()
    for kind in sorted(by_kind):
        c = by_kind[kind]
        total.update(c)
        slow, rss = peak[kind]
        print(f"{kind:18} {c['inputs']:7,d} {c['exit 0']:7,d} {c['exit 1']:7,d} {c['exit 2']:7,d} "
              f"{c['killed']:7,d} {c['failed']:7,d} {slow:8.2f}s {rss / 1024:7.0f}MB")
    print("-" * len(header))
    print(f"{'all':18} {total['inputs']:7,d} {total['exit 0']:7,d} {total['exit 1']:7,d} "
          f"{total['exit 2']:7,d} {total['killed']:7,d} {total['failed']:7,d}")
    case, result = summary["slowest"]
    print(f"\nslowest: {case.name} ({case.kind}, {case.command}): {result.seconds:.2f} s")
    ranked = sorted(zip(cases, results), key=lambda cr: -cr[1].seconds)
    slow = [(c, r) for c, r in ranked if not r.timed_out][:10]
    print("slowest that finished: " + ", ".join(f"{c.name} {r.seconds:.1f} s" for c, r in slow))
    case, result = summary["biggest"]
    print(f"peak memory: {result.maxrss_kb / 1024:.0f} MB (maximum resident set, the "
          f"{result.baseline_kb / 1024:.0f} MB the driver shares at the fork included) for "
          f"{case.name} ({case.kind}, {case.command})")

    failures = summary["failures"]
    groups: dict[str, list] = defaultdict(list)
    for case, result, found in failures:
        groups[hostile.signature(case, found)].append((case, result, found))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    saved = {}
    for case, result, found in failures:
        directory = out / _safe(case.name)
        saved[case.name] = hostile.reproducer(case, directory, "; ".join(found))
        (directory / "stderr.txt").write_text(result.stderr)
        (directory / "stdout.txt").write_text(result.stdout)
    print(f"\n{len(failures):,d} failing runs in {len(groups)} classes"
          + (f"; reproducers under {out}/" if failures else ""))
    work = tempfile.mkdtemp(prefix="planc-hostile-shrink-")
    document = {"runs": len(cases), "seconds": seconds, "args": vars(args),
                "by_kind": {k: dict(v) for k, v in by_kind.items()}, "classes": []}
    try:
        for number, (sig, members) in enumerate(sorted(groups.items(), key=lambda g: -len(g[1])), 1):
            kinds = Counter(case.kind for case, _, _ in members)
            smallest = min(members, key=lambda m: (len(m[0].plan or b"") if m[0].plan is not None
                                                   else 10**9, m[0].name))
            case, result, found = smallest
            print(f"\n[{number}] {sig}: {len(members):,d} runs "
                  f"({', '.join(f'{k} {n}' for k, n in kinds.most_common())})")
            print(f"    e.g. {case.name}: planc {' '.join(case.argv('DIR'))[:160]}")
            print(f"    input: {hostile.describe(case)}")
            for problem in found:
                print(f"    {problem[:300]}")
            print(f"    {result.seconds:.2f} s, {result.maxrss_kb / 1024:.0f} MB, exit "
                  f"{result.status if result.status is not None else 'signal ' + str(result.signal)}")
            print(f"    reproducer: {os.path.relpath(saved[case.name], ROOT)}")
            entry = {"signature": sig, "runs": len(members), "kinds": dict(kinds),
                     "example": case.name, "problems": found, "seconds": result.seconds,
                     "maxrss_kb": result.maxrss_kb, "status": result.status,
                     "reproducer": saved[case.name], "members": [m[0].name for m in members]}
            if (not args.no_shrink and case.plan is not None and len(case.plan) <= SHRINK_LIMIT
                    and not result.timed_out and len(case.plan) > 40):
                small = shrink(case, sig, args, work)
                if len(small.plan) < len(case.plan):
                    path = hostile.reproducer(small, out / _safe(small.name), sig)
                    print(f"    shrunk to {len(small.plan):,d} bytes: {small.plan[:200]!r}")
                    print(f"    reproducer: {os.path.relpath(path, ROOT)}")
                    entry["shrunk"] = {"bytes": len(small.plan), "reproducer": path}
            document["classes"].append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    slow_case, slow_result = summary["slowest"]
    big_case, big_result = summary["biggest"]
    document["slowest"] = {"name": slow_case.name, "seconds": slow_result.seconds}
    document["slowest_finished"] = [
        {"name": c.name, "seconds": r.seconds, "maxrss_kb": r.maxrss_kb}
        for c, r in sorted(zip(cases, results), key=lambda cr: -cr[1].seconds)
        if not r.timed_out][:30]
    document["peak"] = {"name": big_case.name, "maxrss_kb": big_result.maxrss_kb}
    (out / "report.json").write_text(json.dumps(document, indent=2, default=str))
    print(f"\nreport: {os.path.relpath(out / 'report.json', ROOT)}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=3000, help="mutants [3000]")
    parser.add_argument("--seed", type=int, default=hostile.SEED, help="mutation seed")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time [2]")
    parser.add_argument("--time-limit", type=float, default=hostile.TIME_LIMIT,
                        help="seconds of wall-clock time per input [20]")
    parser.add_argument("--memory-limit-gib", type=float, default=hostile.MEMORY_LIMIT / 2**30,
                        help="address space per input, GiB [2]")
    parser.add_argument("--commands", choices=("all", "rotate"), default="all",
                        help="extremes under every command, or one each [all]")
    parser.add_argument("--kinds", help="only these kinds (comma-separated)")
    parser.add_argument("--exec-every", type=int, default=25,
                        help="also run every N-th input through the planc script [25]")
    parser.add_argument("--no-shrink", action="store_true", help="do not shrink failures")
    parser.add_argument("--out", default=str(ROOT / "build" / "hostile"),
                        help="reproducers and report.json [build/hostile]")
    args = parser.parse_args(argv)
    args.memory_limit = int(args.memory_limit_gib * 2**30)
    cases = corpus(args.count, args.seed, args.commands, args.exec_every)
    if args.kinds:
        keep = set(args.kinds.split(","))
        cases = [c for c in cases if c.kind in keep]
    print(f"{len(cases):,d} runs: " + ", ".join(f"{k} {n}" for k, n in
                                               sorted(Counter(c.kind for c in cases).items())),
          file=sys.stderr)
    work = tempfile.mkdtemp(prefix="planc-hostile-")
    started = time.monotonic()
    try:
        results = run(cases, args.workers, args.time_limit, args.memory_limit, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.memory_limit_gib = args.memory_limit / 2**30
    return report(cases, results, args, Path(args.out), time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())

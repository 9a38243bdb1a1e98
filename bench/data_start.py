"""Benchmark: what planc run reads of a large token file before any rank starts.

A sparse file of 100 GB of uint32 tokens (a header, then zeros: every id is 0, valid;
no disk space is used) is checked as ``planc run`` checks it before the ranks start
(planc.runtime.engine.data.check_file with its default scan limit: the header and the size),
then as planc run checked every file before issue 26 (a scan of every token, 4 MiB at a
time, reduced by torch). torch is imported first, outside both figures.

    .venv/bin/python bench/data_start.py [--gb 100] [--dir /tmp]

Measured on this project's shared 2-core machine (issue 26), see docs/data.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from planc.runtime.engine.data import SCAN_LIMIT, check_file
from planc.data.tokens import header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=100.0, help="size of the file, in GB")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to put it")
    args = parser.parse_args()
    import torch  # noqa: F401 (the scan's reducer: imported before the clock starts)

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = os.path.join(directory, "big.tokens")
        with open(path, "wb") as out:
            out.write(header(4))
        os.truncate(path, len(header(4)) + int(args.gb * 1e9) // 4 * 4)
        for limit, what in ((SCAN_LIMIT, "header and size (planc run now)"),
                            (None, "every token (planc run before issue 26)")):
            start = time.perf_counter()
            check_file(path, seq=1024, vocab=50257, scan_limit=limit)
            print(f"{args.gb:g} GB, {what}: {time.perf_counter() - start:.3f} s", flush=True)


if __name__ == "__main__":
    main()

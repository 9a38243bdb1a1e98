"""The ranks' output as planc run's console shows it: each rank's new complete lines,
read from its log directory's stdout.log and stderr.log, with ``[rank R]`` before them;
the cause of a failure once (planc.runtime.launcher.launch decides when to copy).
"""

from __future__ import annotations

import os
import sys


def copy_output(ranks: list, lost_peers: bool = False) -> None:
    """New complete lines of every rank's output, to this console with ``[rank R]``. A
    rank's report of a lost peer is held back unless ``lost_peers`` (the run ended
    without a rank's own failure, which would say why); a one-line error another rank
    already printed is left out (``same_as``)."""
    for entry in ranks:
        for stream, console in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            path = os.path.join(entry.log_dir, f"{stream}.log")
            try:
                with open(path, "rb") as handle:
                    handle.seek(entry.offsets[stream])
                    data = handle.read()
            except OSError:
                continue
            # read before the mark: the rank writes its mark before the report
            held = entry.lost_peer() if stream == "stderr" and not lost_peers else None
            if held is not None:
                data = data[:max(0, held - entry.offsets[stream])]
            if not data:
                continue
            entry.offsets[stream] += len(data)
            data = entry.partial[stream] + data
            *lines, entry.partial[stream] = data.split(b"\n")
            if entry.process.exitcode is not None and entry.partial[stream]:
                lines.append(entry.partial[stream])
                entry.partial[stream] = b""
            for line in lines:
                text = line.decode('utf-8', errors='replace')
                if stream == "stderr" and text.startswith("planc: error: "):
                    first = next((e for e in ranks if text in e.errors), None)
                    if first is not None and first is not entry:
                        entry.same_as = first.rank
                        continue
                    entry.errors.append(text)
                console.write(f"[rank {entry.rank}] {text}\n")
            console.flush()

"""Benchmark: parse and check a generated 5,000-line plan; lay out 16,384 ranks.

Goal (issue 2): under 1 s each on a 2-core machine. Each figure is the median of
several runs; the baseline is lark parsing the same text into a plain parse tree with
the same grammar (no AST, no checks), measured in the same run, so the ratio shows
what planc adds on top of the parser itself.

    .venv/bin/python bench/parse.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lark  # noqa: E402

from planc.lang import load_text  # noqa: E402
from planc.lang.parser import _BracketAwareNewlines, grammar_text  # noqa: E402
from planc.plan.layout import Layout  # noqa: E402
from planc.plan.plan import Mesh  # noqa: E402
from planc.views import layout_text  # noqa: E402


def generated_plan(lines: int = 5000) -> str:
    """A valid plan of about ``lines`` lines: one pipeline stage per line, each under a
    few lines of comments, at planc's limits (1,024 layers, pp x microbatches 131,072)."""
    stages = 1024
    comments = max(1, round((lines - 40) / stages) - 1)
    out = ["# generated for bench/parse.py", "plan generated {",
           "  model gpt {", f"    layers = {stages}", "    hidden = 1024", "    heads = 16",
           "    ffn = 4 * hidden", "    vocab = 32000", "    seq = 2048",
           f"    batch = {2 * 128}", "    dtype = bf16", "  }",
           "  mesh {", "    tp = 1", f"    pp = {stages}", "    dp = 2", "  }",
           "  topology { devices_per_node = 2 }",
           "  shard {", "    pp {", "      stages = ["]
    for stage in range(stages):
        out += [f"        # stage {stage}: one layer ({line} of {comments})"
                for line in range(1, comments + 1)]
        out.append(f"        {stage}..{stage},")
    out += ["      ]", "    }", "    dp { zero = 1 }", "  }",
            "  schedule { microbatches = 128; pipeline = 1f1b }",
            "  optimize { fuse = on; bucket = 25MB; route = auto; overlap = on }",
            "  train { steps = 3; optimizer = adamw(lr = 1e-3, betas = [0.9, 0.95]); seed = 0 }",
            "}"]
    return "\n".join(out) + "\n"


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    text = generated_plan()
    loaded = load_text(text, "generated.plan")
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    plain = lark.Lark(grammar_text(), parser="lalr", postlex=_BracketAwareNewlines())
    baseline = timed(lambda: plain.parse(text), args.repeat)
    check = timed(lambda: load_text(text, "generated.plan"), args.repeat)

    layout = Layout(Mesh(tp=8, cp=2, pp=16, dp=64), devices_per_node=8)

    def lay_out():
        fresh = Layout(layout.mesh, layout.devices_per_node)
        json.dumps(fresh.to_dict(), separators=(",", ":"))
        layout_text.render(fresh, "bench")

    layout_s = timed(lay_out, args.repeat)
    print(f"parse+check {text.count(chr(10))}-line plan: {check:.3f} s "
          f"(lark parse tree alone: {baseline:.3f} s, ratio {check / baseline:.2f})")
    print(f"layout of {layout.world} ranks (JSON + text): {layout_s:.3f} s")
    ok = check < 1.0 and layout_s < 1.0
    print("goal (< 1 s each):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

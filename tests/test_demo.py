"""make demo: it trains plans/demo.plan on the project's corpus (made first if missing)
and ends by printing where the build directory, the comm graph and the report are, as
absolute paths of the files its own commands wrote."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import ROOT


def test_make_demo_trains_on_the_corpus_and_prints_the_three_paths():
    # -n prints the commands without running them; -B takes every target as out of date,
    # so the corpus's command shows whether or not data/ exists here.
    done = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    compile_line = next(line for line in lines if " compile " in line)
    assert compile_line == (".venv/bin/planc compile plans/demo.plan --set "
                            "'train.data=\"../data/tiny-corpus.tokens\"' -o build/demo")
    build = ROOT / "build" / "demo"
    assert (".venv/bin/planc run build/demo --check --metrics build/demo/metrics.jsonl "
            "--force") in lines
    assert ".venv/bin/planc graph build/demo -o build/demo/graph.html --force" in lines
    assert (".venv/bin/planc report build/demo -o build/demo/report.html --metrics "
            "build/demo/metrics.jsonl --force") in lines
    shown = [re.fullmatch(r'echo "(\w+): +(.*)"', line) for line in lines]
    assert [(m[1], m[2]) for m in shown if m] == [
        ("build", f"{build}/"), ("graph", f"{build}/graph.html"),
        ("report", f"{build}/report.html")]
    corpus = next(k for k, line in enumerate(lines)
                  if line.endswith(" -m planc.tools.corpus -o data/tiny-corpus.tokens"))
    assert corpus < lines.index(compile_line)  # made before the demo trains on it

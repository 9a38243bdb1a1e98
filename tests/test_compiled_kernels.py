"""optimize { compile = on }: the key, what the build carries to the ranks, a rank that
runs the family's formulas through torch.compile and trains as the one-process
reference does, and a rank that cannot compile them (planc.runtime.families.compiled)."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from conftest import one_rank_printed, run_one_rank

from planc.lang import load_text
from planc.lower.tabulate_model import model_table
from planc.program.model_table import ModelTable
from planc.runtime.families.compiled import CPP_COMPILERS

LLAMA = """plan tiny_llama {
  model llama { layers = 2; hidden = 32; heads = 4; kv_heads = 2; ffn = 48; vocab = 128;
                seq = 16; batch = 4 }
  mesh { }
  optimize { compile = on }
  train { steps = 2; optimizer = adamw(lr = 1e-3); seed = 3 }
}
"""

# One rank of LLAMA, torchrun's way, with --check; then how many graphs dynamo compiled.
COMPILED_RUN = textwrap.dedent("""
    import json, sys
    import torch
    import planc.runtime.worker as worker
    status = worker.main([sys.argv[1], "--steps", "2", "--check"])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(json.dumps({"status": status, "graphs": graphs}))
""")
NO_COMPILER = textwrap.dedent("""
    import sys
    import planc.runtime.worker as worker
    sys.exit(worker.main([sys.argv[1], "--steps", "1"]))
""")


def test_the_key_reaches_the_model_table_and_back():
    loaded = load_text(LLAMA, "tiny.plan")
    assert loaded.ok, loaded.diagnostics
    assert loaded.plan.optimize.compile is True
    table = model_table(loaded.plan)
    assert table.compile_kernels is True
    written = table.to_json()
    assert written["kernels"] == {"compile": True}
    assert ModelTable.from_json(json.loads(json.dumps(written))).compile_kernels is True
    # off, the default, writes nothing: the builds of before read the same
    off = model_table(load_text(LLAMA.replace("compile = on", "compile = off"), "o.plan").plan)
    assert "kernels" not in off.to_json()
    assert ModelTable.from_json(off.to_json()).compile_kernels is False


def test_a_damaged_kernels_entry_is_refused_by_name():
    written = model_table(load_text(LLAMA, "tiny.plan").plan).to_json()
    for damaged in ({"compile": "yes"}, ["compile"], {"compile": True, "mode": 1}):
        with pytest.raises(ValueError, match="kernels"):
            ModelTable.from_json({**written, "kernels": damaged})


def test_the_gpt_family_has_nothing_to_compile_and_says_so():
    loaded = load_text("plan g {\n  model gpt { layers = 2; hidden = 64; heads = 4; "
                       "vocab = 256; seq = 32; batch = 4 }\n  optimize { compile = on }\n}\n",
                       "g.plan")
    assert loaded.ok
    assert [d.message for d in loaded.diagnostics] == [
        "compile = on has no effect on the gpt family: its norms and activations are one "
        "kernel each already"]


@pytest.mark.skipif(not any(shutil.which(c) for c in CPP_COMPILERS),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_a_rank_runs_the_compiled_formulas_and_trains_as_the_reference(tmp_path):
    seen = one_rank_printed(run_one_rank(COMPILED_RUN, tmp_path, plan_text=LLAMA))
    assert seen["status"] == 0  # --check: every loss and parameter within its tolerance
    # RMSNorm, the rotary embedding and SwiGLU: one graph each at least
    assert seen["graphs"] >= 3


def test_a_cpu_rank_without_a_cpp_compiler_stops_before_training(tmp_path):
    empty = tmp_path / "no-tools"
    empty.mkdir()
    done = run_one_rank(NO_COMPILER, tmp_path, plan_text=LLAMA, env={"PATH": str(empty)})
    assert done.returncode != 0
    assert ("planc: error: optimize { compile = on } needs a C++ compiler on a CPU rank "
            "(g++, c++, clang++ on PATH), which this one lacks; install one (Debian: "
            "apt-get install g++) or set compile = off") in done.stderr
    assert "Traceback" not in done.stderr

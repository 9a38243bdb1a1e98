# Two commands for a new machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-gigabyte CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test bench bytecode bench-topology install clean corpus loss-curves

# pip compiles the bytecode of what it installs one file at a time (12,000 files, 73 s of
# CPU here, and needed: where PYTHONDONTWRITEBYTECODE is set each process would compile
# torch's modules again); compileall does it on every core. As pip does, a file of a
# package that does not compile (templates, other Pythons' tests) is left without.
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev,run]' '$(TORCH)'
	$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# planc's bytecode, written ahead of the processes that read it: where
# PYTHONDONTWRITEBYTECODE is set (some CI images set it) no process writes its own, and
# each planc process would compile about 250 modules again (0.8 s of the 1.3 s of a
# `planc verify` on a small build, 0.5 s with the bytecode here). Only changed files
# are compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q planc tests bench

# The demo measures this machine with 8 gloo ranks (planc calibrate --quick, about 10 s
# on 2 idle cores), trains plans/demo.plan on 8 local processes on the corpus below,
# priced on that measurement, and checks it against one process (about 20 s on 2 cores),
# then writes the comm graph and the report; --force: a second `make demo` replaces the
# first one's machine, metrics, graph and report.
DEMO    := build/demo
CORPUS  := data/tiny-corpus.tokens
MACHINE := build/demo-machine.json
HERE    := --set 'topology.preset="../$(MACHINE)"'

demo: bytecode $(CORPUS)
	@mkdir -p build
	$(VENV)/bin/planc calibrate -o $(MACHINE) --ranks 8 --quick --repeats 3 --force
	@echo
	$(VENV)/bin/planc check plans/demo.plan $(HERE) --verbose
	@echo
	$(VENV)/bin/planc layout plans/demo.plan $(HERE)
	@echo
	$(VENV)/bin/planc compile plans/demo.plan --set 'train.data="../$(CORPUS)"' $(HERE) -o $(DEMO)
	@echo
	$(VENV)/bin/planc run $(DEMO) --check --metrics $(DEMO)/metrics.jsonl --force
	$(VENV)/bin/planc graph $(DEMO) -o $(DEMO)/graph.html --force
	$(VENV)/bin/planc report $(DEMO) -o $(DEMO)/report.html --metrics $(DEMO)/metrics.jsonl --force
	@echo
	@$(PY) -c 'import json, sys; loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]; \
	  print(f"loss: {loss[0]:.2f} at step 1, {loss[-1]:.2f} at step {len(loss)}")' \
	  $(DEMO)/metrics.jsonl
	@$(VENV)/bin/planc simulate $(DEMO) --json > $(DEMO)/simulated.json
	@$(PY) -c 'import json, statistics, sys; s = json.load(open(sys.argv[1])); \
	  r = [json.loads(l) for l in open(sys.argv[2])][2:]; p = s["step_seconds"]; \
	  m = statistics.median(x["time_s"] for x in r); u = statistics.median(x["mfu"] for x in r); \
	  g = s["peak_flops"] / 1e9; \
	  print(f"step:   {p * 1e3:.0f} ms predicted on this machine as calibrated, {m * 1e3:.0f} ms " \
	        f"measured ({p / m - 1:+.0%}; median after 2 warm-up steps); MFU {u:.1%} of the " \
	        f"measured {g:.3g} GFLOP/s per rank")' \
	  $(DEMO)/simulated.json $(DEMO)/metrics.jsonl
	@echo "build:  $(abspath $(DEMO))/"
	@echo "graph:  $(abspath $(DEMO))/graph.html"
	@echo "report: $(abspath $(DEMO))/report.html"

# The suite in pytest-xdist worker processes, one more than the cores, up to 4, a test
# file per worker at a time; a file's shared fixtures are built once. Many tests wait on
# processes they started (ranks, launchers, signals), so a worker per core leaves the
# cores idle a third of the time: on this 2-core machine 3,271 tests took 14:47 with 2
# workers (1,127 CPU-seconds) and 12:47 with 3 (1,049), one run each, 2026-12-04 (the
# first shared the machine with a few minutes of other tests); on 2026-11-29, on a busy
# machine, 15:31 with 2 and 14:28 with 3. Two workers more than the cores is too many:
# 3,279 tests took 12:55 with 3 and 14:51 with 4 (1,050 and 1,200 CPU-seconds; one run
# each, the quiet machine, 2026-12-04). Files start in the order tests/conftest.py
# gives them (the longest first), not pytest-xdist's own.
TEST_WORKERS ?= $(shell n=$$(( $$(nproc 2>/dev/null || echo 2) + 1 )); echo $$(( n > 4 ? 4 : n )))
# More pytest options, e.g. make test PYTEST_ARGS=--durations=40 (the slowest tests), or
# PYTEST_ARGS="-p suite_cpu" PYTHONPATH=bench: each test's CPU-seconds, with the processes
# it starts (bench/suite_cpu.py, root only, prints them per file).
PYTEST_ARGS ?=

test: bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: bytecode
	$(PY) bench/parse.py
	$(PY) bench/compile.py
	$(PY) bench/limits.py
	$(PY) bench/run.py
	$(PY) bench/peers.py

# Two layouts of plans/llama-small.plan, 50 steps each on the corpus, drawn by planc plot
# into docs/loss-two-plans.png (docs/metrics.md): the two curves lie on one another.
loss-curves: $(STAMP) $(CORPUS)
	$(PY) bench/loss_curves.py --plot docs/loss-two-plans.png

# Routes on an emulated two-node cluster: needs root (network namespaces, veth, tc).
bench-topology: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) bench/topology.py --json build/topology.json --plot docs/topology.png

# A tiny tokenised corpus, generated here without network, its tokenizer trained by the
# tokenizers library (planc/data/corpus.py, docs/data.md): data/tiny-corpus.tokens, .json
# (the tokenizer.json) and .txt.
corpus: $(STAMP)
	$(PY) -m planc.data.corpus -o $(CORPUS) --force

$(CORPUS): | $(STAMP)
	$(PY) -m planc.data.corpus -o $@ --force

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
	find planc tests bench -name __pycache__ -prune -exec rm -rf {} +

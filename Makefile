# Two commands for a new machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-gigabyte CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test bench bench-topology install clean corpus

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,run]' '$(TORCH)'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planc check plans/gpt-tiny.plan --verbose
	@echo
	$(VENV)/bin/planc layout plans/gpt-tiny.plan
	@echo
	$(VENV)/bin/planc compile plans/gpt-tiny.plan -o build/gpt-tiny
	@echo
	$(VENV)/bin/planc run build/gpt-tiny --check --metrics build/gpt-tiny/metrics.jsonl

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/parse.py
	$(PY) bench/compile.py
	$(PY) bench/run.py
	$(PY) bench/peers.py

# Routes on an emulated two-node cluster: needs root (network namespaces, veth, tc).
bench-topology: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) bench/topology.py --json build/topology.json --plot docs/topology.png

# A tiny tokenised corpus, generated here without network or extra packages
# (planc/tools/corpus.py, docs/data.md): data/tiny-corpus.tokens, .json and .txt.
corpus:
	$(PYTHON) -m planc.tools.corpus -o data/tiny-corpus.tokens

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis

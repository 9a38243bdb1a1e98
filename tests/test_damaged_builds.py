"""Damaged builds (the corpus and its runner: tests/build_damages.py), part one: the
damage to the build's documents (build.json, plan.json, graph.json, summary.json), and
the pristine build through every command. The damage to programs/ runs in
tests/test_damaged_programs.py, so that two workers share the corpus's runs."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.build_damages import (ALL, DOCUMENTS, FILES, PROGRAMS, WRONG, check_every_run_ran,
                                 check_refused_cleanly, check_refused_not_ignored,
                                 damaged_fixtures, damages, problems)

pristine, corpus, runs = damaged_fixtures(DOCUMENTS, with_pristine=True)


def test_the_corpus_is_systematic_and_deterministic(pristine, corpus):
    names = [damage.name for damage in corpus]
    assert len(names) == len(set(names)) >= 600  # the reporter tried 135
    assert names == [damage.name for damage in damages(pristine)]
    by_file = Counter(damage.file for damage in corpus)
    assert set(by_file) == {*FILES, PROGRAMS}
    for file in FILES:  # every file: every whole-file damage, every top-level key deleted
        kinds = {name.split(":", 1)[1] for name in names if name.startswith(f"{file}:")}
        assert {"missing", "empty", "not-utf8", "json-list", "json-null", "json-nan",
                "directory", "fifo", "dev-zero", "outside-link", "cut-at-1", "cut-in-half",
                "cut-last-byte"} <= kinds, file
        document = json.loads((pristine / file).read_text())
        assert {f"{key}-deleted" for key in document} <= kinds, file
    values = Counter(name.rsplit("=", 1)[1] for name in names
                     if "=" in name and "=regression-" not in name)
    assert set(values) == set(WRONG)  # every wrong value is used somewhere


def test_every_run_ran(runs, corpus):
    check_every_run_ran(runs, corpus, DOCUMENTS, with_pristine=True)


def test_the_pristine_build_passes_every_command(runs):
    results, _ = runs
    pristine = [(job, result) for damage, job, result in results if damage is None]
    assert len(pristine) == len(ALL)
    for job, result in pristine:
        assert result.status == 0 and not problems(result), (job.name, result.stderr)


@pytest.mark.parametrize("file", DOCUMENTS)
def test_damaged_builds_are_refused_cleanly(runs, file):
    check_refused_cleanly(runs, file)


def test_damage_is_refused_not_ignored(runs, pristine):
    check_refused_not_ignored(runs, pristine, DOCUMENTS, (
        "build.json:missing", "plan.json:cut-in-half", "graph.json:fifo"))

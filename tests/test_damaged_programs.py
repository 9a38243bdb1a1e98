"""Damaged builds (the corpus and its runner: tests/build_damages.py), part two: the
damage to programs/ (each program file, the rank, group, route and model tables, and
the directory itself). tests/test_damaged_builds.py runs the damage to the build's
documents; the two files share the corpus's runs between two workers."""

from __future__ import annotations

import pytest

from tests.build_damages import (PROGRAM_FILES, check_every_run_ran, check_refused_cleanly,
                                 check_refused_not_ignored, damaged_fixtures)

pristine, corpus, runs = damaged_fixtures(PROGRAM_FILES, with_pristine=False)


def test_every_run_ran(runs, corpus):
    check_every_run_ran(runs, corpus, PROGRAM_FILES, with_pristine=False)


@pytest.mark.parametrize("file", PROGRAM_FILES)
def test_damaged_programs_are_refused_cleanly(runs, file):
    check_refused_cleanly(runs, file)


def test_damage_to_programs_is_refused_not_ignored(runs, pristine):
    check_refused_not_ignored(runs, pristine, PROGRAM_FILES, (
        "programs/stage0.json:dev-zero", "programs/:missing",
        "programs/ranks.json:world=infinity"))

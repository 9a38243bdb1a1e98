"""A model family is its description (planc.models.family.Family): its keys, their
defaults, its checks. A family registered here, and nowhere else, is read, checked and
printed by the language, the checker and the plan text as it stands; and nothing
outside planc/models and planc/runtime branches on a family's name."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from planc import models
from planc.checkpoint.training_record import TrainingRecord
from planc.lang import load_text
from planc.vocabulary.kinds import Integer, Key, Real
from planc.models import FAMILIES, gpt
from planc.models.family import Finding
from planc.plan.plan_json import plan_from_dict
from planc.views import plan_summary

ROOT = Path(__file__).resolve().parent.parent


def _window_fits(model) -> Finding | None:
    if model.window <= model.seq:
        return None
    return Finding(f"window ({model.window}) is more than seq ({model.seq})",
                   ("model.window", "model.seq"), f"try window = {model.seq}")


def _window_splits_over_tp(model, tensor, mesh) -> Finding | None:
    if model.window % mesh.tp == 0:
        return None
    return Finding(f"window ({model.window}) must divide by tp ({mesh.tp})", ("mesh.tp",))


# gpt's operators, parameters and FLOPs under another name, with two keys of its own:
# a sliding attention window and a dropout rate.
TOY = dataclasses.replace(
    gpt.FAMILY, name="toy", summary="gpt with a sliding attention window",
    keys={**gpt.FAMILY.keys,
          "window": Key(Integer(1), lambda scope: scope.value("seq"),
                        doc="tokens each query attends to (default: seq)"),
          "dropout": Key(Real(0.0, 1.0), 0.1, doc="dropout rate")},
    model_checks=(_window_fits,), tensor_parallel_checks=(_window_splits_over_tp,))

PLAN = """plan toy_plan {{
  model toy {{ layers = 2; hidden = 32; heads = 4; vocab = 64; seq = 16; batch = 4{extra} }}
  mesh {{ tp = {tp} }}
}}
"""


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)  # the one registry line, for this test


def _errors(loaded) -> list[str]:
    return [f"{d.span.line}:{d.span.column}: {d.message}" + "".join(f" | {h}" for h in d.hints)
            for d in loaded.diagnostics if d.is_error]


def test_a_family_registered_with_its_description_is_read_checked_and_printed(toy):
    loaded = load_text(PLAN.format(extra="; window = 8", tp=2))
    assert loaded.ok, loaded.diagnostics
    model = loaded.plan.model
    assert (model.family, model.ffn, model.window, model.dropout) == ("toy", 128, 8, 0.1)
    assert model.options == {"window": 8, "dropout": 0.1}
    text = plan_summary.settings(loaded.plan)
    assert text.startswith("model toy  layers 2, hidden 32, heads 4 (head_dim 8), window 8, "
                           "dropout 0.1, ffn 128, vocab 64, seq 16, batch 4, fp32, "
                           "tie_embeddings off; ")
    assert plan_summary.one_line(loaded.plan, "toy.plan").startswith("toy.plan: ok: plan toy_plan")
    # plan.json holds the family's own keys, and reads back to the same plan
    data = json.loads(json.dumps(loaded.plan.to_dict()))
    assert data["model"]["options"] == {"window": 8, "dropout": 0.1}
    assert plan_from_dict(data) == loaded.plan


def test_a_family_s_defaults_and_checks_are_its_own(toy):
    assert load_text(PLAN.format(extra="", tp=1)).plan.model.window == 16
    assert load_text(PLAN.format(extra="", tp=1), overrides=["model.window=4"]
                     ).plan.model.window == 4
    assert _errors(load_text(PLAN.format(extra="; window = 32", tp=1))) == [
        "2:93: window (32) is more than seq (16) | try window = 16"]
    assert _errors(load_text(PLAN.format(extra="; window = 9", tp=2))) == [
        "3:15: window (9) must divide by tp (2)"]
    assert _errors(load_text(PLAN.format(extra="; windw = 8", tp=1))) == [
        "2:84: unknown key 'windw' in model toy { } | did you mean 'window'?"]
    # the other families do not have its keys
    gpt_plan = PLAN.replace("model toy", "model gpt")
    assert "unknown key 'window'" in _errors(load_text(gpt_plan.format(extra="; window = 8",
                                                                        tp=1)))[0]


def test_a_family_unregistered_is_unknown_and_plans_of_the_others_hold_no_options():
    assert "toy" not in models.FAMILIES
    assert _errors(load_text(PLAN.format(extra="", tp=1))) == [
        "2:9: unknown model family 'toy'; planc knows gpt, llama, moe, deepseek"]
    gpt_plan = load_text(PLAN.replace("model toy", "model gpt").format(extra="", tp=1)).plan
    assert "options" not in gpt_plan.to_dict()["model"]
    assert "options" not in TrainingRecord.of(gpt_plan.to_dict()).model  # a checkpoint's manifest, as before
    with pytest.raises(AttributeError):
        gpt_plan.model.window


def _family_comparisons(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """'file:line' of each comparison with a family's name: ``family == "llama"``,
    ``name in ("gpt", ...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) \
                else [operand]
            if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_nothing_outside_the_families_and_their_kernels_branches_on_a_family_name(tmp_path):
    names = set(FAMILIES)
    outside = [path for path in sorted((ROOT / "planc").rglob("*.py"))
               if not path.is_relative_to(ROOT / "planc" / "models")
               and not path.is_relative_to(ROOT / "planc" / "runtime")]
    assert len(outside) > 50
    assert [hit for path in outside for hit in _family_comparisons(path, names)] == []
    # the scan finds what it is meant to find
    probe = tmp_path / "probe.py"
    probe.write_text('x = 1\nif model.family == "llama":\n    pass\nok = name in ("gpt", "x")\n')
    assert _family_comparisons(probe, names, tmp_path) == ["probe.py:2", "probe.py:4"]

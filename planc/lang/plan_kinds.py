"""The kinds of values only a plan's own blocks hold: the mesh's axis order, pipeline
stage ranges, the optimizer call, the data source and the topology preset."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from planc.diagnostics import Span
from planc.vocabulary import ast
from planc.vocabulary.kinds import (Choice, Kind, Problem, Real, did_you_mean, evaluate_integer,
                              join_words, named_arguments, word_text)
from planc.plan.presets import PRESETS
from planc.plan.mesh import AXES


class AxisOrder(Kind):
    noun = "a list of the four axes tp, cp, pp and dp"

    def read(self, value, scope):
        if not isinstance(value, ast.ListValue):
            raise self.mismatch(value)
        seen: dict[str, ast.Value] = {}
        for item in value.items:
            text = word_text(item)
            if text not in AXES:
                raise Problem(f"'{text or ast.describe(item)}' is not a mesh axis; expected "
                              f"tp, cp, pp or dp", item.span, did_you_mean(text or "", AXES))
            if text in seen:
                raise Problem(f"axis '{text}' appears twice in order", item.span)
            seen[text] = item
        missing = [axis for axis in AXES if axis not in seen]
        if missing:
            raise Problem(f"order must name all four axes; missing {join_words(missing)}",
                          value.span, "for example order = [tp, cp, pp, dp] (fastest first)")
        return tuple(seen)


@dataclass(frozen=True)
class StageRange:
    first: int
    last: int
    span: Span
    # "embedding" or "head": a chunk that runs no transformer layer, only the embedding
    # (the first chunk) or the final norm, head and loss (the last), as Llama 3's layout
    # (Dubey et al. 2024, section 3.3.2); first and last are then placeholders.
    alone: str | None = None


# The words that stand for a chunk with no layer, and where each may stand.
ALONE_CHUNKS = ("embedding", "head")


class Stages(Kind):
    noun = "auto or a list of layer ranges such as [0..3, 4..7]"

    def read(self, value, scope):
        if word_text(value) == "auto":
            return "auto"
        if isinstance(value, ast.Word):
            raise Problem(f"unknown value '{value.text}'; expected auto or a list of layer "
                          f"ranges", value.span, did_you_mean(value.text, ["auto"]))
        if not isinstance(value, ast.ListValue):
            raise self.mismatch(value)
        if not value.items:
            raise Problem("stages must list at least one layer range", value.span)
        ranges = []
        for item in value.items:
            if isinstance(item, ast.Word) and item.text in ALONE_CHUNKS:
                ranges.append(StageRange(0, -1, item.span, item.text))
                continue
            if isinstance(item, ast.Range):
                first = evaluate_integer(item.first, scope)
                last = evaluate_integer(item.last, scope)
            elif isinstance(item, (ast.ListValue, ast.String, ast.Call)):
                raise Problem(f"expected a layer range such as 0..3, got {ast.describe(item)}",
                              item.span)
            else:
                first = last = evaluate_integer(item, scope)
            if first > last:
                raise Problem(f"layer range {first}..{last} is empty (first > last)", item.span,
                              f"write {last}..{first}; a chunk with no layer can only be the "
                              f"first (write embedding) or the last (write head)")
            if first < 0:
                raise Problem(f"layer {first} is negative; layers are numbered from 0", item.span,
                              "the first layer is 0")
            ranges.append(StageRange(first, last, item.span))
        return tuple(ranges)


OPTIMIZER_ARGUMENTS = {
    # name -> (argument -> default); None marks a required argument.
    "sgd": {"lr": None, "momentum": 0.0, "weight_decay": 0.0},
    "adamw": {"lr": None, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}
_ARGUMENT_KINDS = {
    "lr": Real(0.0, None, False), "momentum": Real(0.0, 1.0), "eps": Real(0.0, None, False),
    "weight_decay": Real(0.0),
}
_BETA = Real(0.0)  # below 1 too, checked with its own message


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    arguments: dict[str, Any]


class OptimizerCall(Kind):
    noun = "sgd(lr = ...) or adamw(lr = ...)"

    def read(self, value, scope):
        text = word_text(value)
        if text is not None:
            if text in OPTIMIZER_ARGUMENTS:
                raise Problem(f"{text} needs a learning rate: write {text}(lr = ...)", value.span)
            raise Problem(f"unknown optimizer '{text}'; expected sgd or adamw", value.span,
                          did_you_mean(text, OPTIMIZER_ARGUMENTS))
        if not isinstance(value, ast.Call):
            raise self.mismatch(value)
        if value.name not in OPTIMIZER_ARGUMENTS:
            raise Problem(f"unknown optimizer '{value.name}'; expected sgd or adamw",
                          value.name_span, did_you_mean(value.name, OPTIMIZER_ARGUMENTS))
        allowed = OPTIMIZER_ARGUMENTS[value.name]

        def example(argument: ast.Argument) -> str:
            shown = argument.value.text if isinstance(argument.value, ast.Number) else "0.1"
            return f"for example {value.name}(lr = {shown})"

        given: dict[str, Any] = {name: self._argument(argument) for name, argument in
                                 named_arguments(value, allowed, example).items()}
        missing = [name for name, default in allowed.items()
                   if default is None and name not in given]
        if missing:
            raise Problem(f"{value.name} needs {join_words(missing)}", value.span,
                          f"for example {value.name}(lr = 1e-3)")
        return OptimizerSpec(value.name, {**allowed, **given})

    @staticmethod
    def _argument(argument: ast.Argument) -> Any:
        if argument.name == "betas":
            items = argument.value.items if isinstance(argument.value, ast.ListValue) else ()
            if len(items) != 2:
                raise Problem("betas must be a list of two numbers, such as [0.9, 0.999]",
                              argument.value.span)
            betas = []
            for item in items:
                beta = _BETA.read(item, None)
                if beta >= 1.0:
                    raise Problem(f"each beta must be below 1, got {beta:g}", item.span)
                betas.append(beta)
            return tuple(betas)
        return _ARGUMENT_KINDS[argument.name].read(argument.value, None)


def check_path(value: ast.String, what: str) -> str:
    """A path as written in quotes, if the system can name a file with it: not empty, no
    NUL character (the end of a C string) and no lone surrogate (not encodable)."""
    text = value.value
    if value.malformed:
        raise Problem(f"the {what} path has a malformed escape ({value.malformed}); a "
                      f"backslash starts an escape as in Python: write \\\\ for one",
                      value.span)
    if not text:
        raise Problem(f"the {what} path is empty", value.span)
    if "\0" in text:
        raise Problem(f"the {what} path holds a NUL character, which no file name can hold",
                      value.span)
    try:
        os.fsencode(text)
    except UnicodeEncodeError as exc:
        raise Problem(f"the {what} path holds U+{ord(text[exc.start]):04X}, which no file "
                      f"name can hold", value.span) from None
    return text


@dataclass(frozen=True)
class Mixture:
    """``data = [0.7, "web.tokens", 0.3, "code.tokens"]``: (weight, path, the path's span)
    of each source, as written (planc.data.blend)."""

    sources: tuple[tuple[float, str, Span], ...]


_WEIGHT = Real(0.0, None, False)


class DataSource(Kind):
    noun = "synthetic, a file path in quotes, or a mixture [w1, \"a\", w2, \"b\", ...]"

    def read(self, value, scope):
        if isinstance(value, ast.String):
            return check_path(value, "data")
        if isinstance(value, ast.ListValue):
            return self._mixture(value)
        text = word_text(value)
        if text == "synthetic":
            return "synthetic"
        if text is not None:
            raise Problem(f"unknown value '{text}'; expected synthetic or a file path in "
                          f"quotes", value.span, did_you_mean(text, ["synthetic"]))
        raise self.mismatch(value)

    @staticmethod
    def _mixture(value: ast.ListValue) -> Mixture:
        """Megatron-LM's --data-path form: a weight before each source."""
        items = value.items
        example = 'for example [0.7, "web.tokens", 0.3, "code.tokens"]'
        if len(items) < 4 or len(items) % 2:
            raise Problem("a mixture is a weight before each of at least two token files",
                          value.span, example)
        sources = []
        for weight, path in zip(items[::2], items[1::2]):
            if not isinstance(path, ast.String):
                raise Problem("expected a token file's path in quotes after each weight",
                              path.span, example)
            sources.append((_WEIGHT.read(weight, None), check_path(path, "data"), path.span))
        return Mixture(tuple(sources))


class CheckpointDirectory(Kind):
    noun = "a Hugging Face checkpoint directory's path in quotes"

    def read(self, value, scope):
        if isinstance(value, ast.String):
            return check_path(value, "init")
        raise self.mismatch(value)


class PresetFile(str):
    """A preset given as a quoted path: a topology that ``planc calibrate`` measured."""


class PresetSource(Kind):
    words = tuple(PRESETS)  # the named machines; a quoted path is the other form
    noun = (f"one of {join_words(tuple(PRESETS))}, or the path in quotes of a topology "
            f"written by planc calibrate")

    def read(self, value, scope):
        if isinstance(value, ast.String):
            return PresetFile(check_path(value, "topology"))
        return Choice(tuple(PRESETS)).read(value, scope)


class ClipNorm(Kind):
    """``train.grad_clip``: ``off`` (None) or the norm to clip the gradients to, a number
    > 0 (``torch.nn.utils.clip_grad_norm_``'s ``max_norm``)."""

    noun = "off or a number > 0"

    def read(self, value, scope):
        if isinstance(value, ast.Word):
            if value.text == "off":
                return None
            raise Problem(f"expected {self.noun}, got '{value.text}'", value.span,
                          "grad_clip = 1.0 clips the gradients' global L2 norm to 1.0; "
                          "grad_clip = off leaves them as they are")
        return Real(0.0, minimum_allowed=False).read(value, scope)

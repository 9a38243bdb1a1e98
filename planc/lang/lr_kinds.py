"""The value of ``train { lr_schedule = ... }``: a schedule's name, or a call of it with
named arguments (``cosine(warmup = 100, min_lr = 1e-5)``), read as the optimizer call is
(planc.lang.plan_kinds.OptimizerCall). The formulas are planc.plan.lr_schedule's; what the
arguments must satisfy against train.steps and the optimizer's lr is checked after the
block is read (:func:`findings`), at the argument that is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.diagnostics import Span
from planc.vocabulary import ast
from planc.vocabulary.kinds import (Integer, Kind, Problem, Real, did_you_mean, join_words,
                              named_arguments, word_text)
from planc.plan.lr_schedule import SCHEDULE_ARGUMENTS, LrSchedule, problems

_KINDS = {"warmup": Integer(0), "decay": Integer(1), "min_lr": Real(0.0)}
_EXAMPLES = {"constant": "constant(warmup = 100)", "cosine": "cosine(warmup = 100, min_lr = 1e-5)",
             "linear": "linear(warmup = 100, min_lr = 0)",
             "wsd": "wsd(warmup = 100, decay = 200, min_lr = 0)"}


@dataclass(frozen=True)
class LrScheduleSpec:
    """A schedule as written: the schedule, and where each argument was written (the
    whole value's span for those left to their defaults)."""

    schedule: LrSchedule
    span: Span | None = None
    spans: dict[str, Span] = field(default_factory=dict, compare=False, hash=False)


class LrScheduleCall(Kind):
    noun = "constant, cosine(...), linear(...) or wsd(...)"

    def read(self, value, scope):
        text = word_text(value)
        if text is not None:
            self._known(text, value.span)
            if any(default is None for default in SCHEDULE_ARGUMENTS[text].values()):
                raise Problem(f"{text} needs decay: write {_EXAMPLES[text]}", value.span)
            return LrScheduleSpec(LrSchedule(text), value.span)
        if not isinstance(value, ast.Call):
            raise self.mismatch(value)
        self._known(value.name, value.name_span)
        allowed = SCHEDULE_ARGUMENTS[value.name]
        arguments = named_arguments(value, allowed,
                                    lambda _: f"for example {_EXAMPLES[value.name]}")
        given = {name: _KINDS[name].read(argument.value, scope)
                 for name, argument in arguments.items()}
        spans = {name: argument.value.span for name, argument in arguments.items()}
        missing = [name for name, default in allowed.items()
                   if default is None and name not in given]
        if missing:
            raise Problem(f"{value.name} needs {join_words(missing)}", value.span,
                          f"for example {_EXAMPLES[value.name]}")
        return LrScheduleSpec(LrSchedule(value.name, **given), value.span, spans)

    @staticmethod
    def _known(name: str, span: Span) -> None:
        if name not in SCHEDULE_ARGUMENTS:
            raise Problem(f"unknown lr_schedule '{name}'; expected "
                          f"{join_words(list(SCHEDULE_ARGUMENTS))}", span,
                          did_you_mean(name, SCHEDULE_ARGUMENTS))


def findings(spec: LrScheduleSpec, lr: float, steps: int
             ) -> list[tuple[str, Span | None, str]]:
    """(message, where, hint) of each problem of the schedule for ``steps`` steps at
    ``lr`` (planc.plan.lr_schedule.problems), at the argument concerned."""
    return [(message, spec.spans.get(argument, spec.span), hint)
            for argument, message, hint in problems(spec.schedule, lr, steps)]

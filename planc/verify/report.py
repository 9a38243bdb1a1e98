"""What the verifier reports: problems, and the words it names ranks and instructions by."""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.diagnostics import counted
from planc.program.program import EVENT_NAMING_OPS, Instruction

MAX_PROBLEMS = 20


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS and message not in self.problems:
            self.problems.append(message)

    @property
    def ok(self) -> bool:
        return not self.problems


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(map(str, ranks[:6])) + (f", ... {ranks[-1]}" if len(ranks) > 6 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def describe(instruction: Instruction, microbatch: int | None = None) -> str:
    what = instruction.event if instruction.op in EVENT_NAMING_OPS else instruction.node
    mb = f" (microbatch {microbatch})" if microbatch is not None and \
        instruction.per_microbatch else ""
    return f"{instruction.op} {what}{mb} on stream {instruction.stream}"


def failed_line(path: str, report: Report) -> str:
    """One line for programs that fail: the first problem, and how many more."""
    more = len(report.problems) - 1
    return (f"the programs of {path} fail verification: {report.problems[0]}" + (
        f" (and {counted(more, 'more problem')}; planc verify {path} lists them)" if more
        else ""))


def part_text(part: str) -> str:
    """A program's part as the messages name it: the prologue, the epilogue, block F0."""
    return part if part in ("prologue", "epilogue") else f"block {part}"


class Lazy:
    """Text computed the first time a report needs it."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __str__(self) -> str:
        if self.value is None:
            self.value = self.make()
        return self.value

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731

"""The checker's rules for ``train { data }`` and ``eval_data``: each token file (or each
source of a mixture) checked where the plan names it, relative to the plan's directory,
and, with ``init``, cut by the init checkpoint's tokenizer (planc.data.provenance). No
torch: planc.data reads the files."""

from __future__ import annotations

import os

from planc.diagnostics import warning
from planc.data.provenance import vocabulary_overflow
from planc.data.tokens import SCAN_LIMIT
from planc.lang.plan_kinds import Mixture
from planc.plan.data_source import blend_of, blend_text
from planc.plan.plan import Model

# Larger data files are checked a step at a time by planc run, as each step reads its
# samples; check stays fast (pure Python scans tens of MB/s).
DATA_SCAN_LIMIT = SCAN_LIMIT
TOKENIZER_HINT = ("prepare the data with the checkpoint's tokenizer: planc data prepare "
                  "SOURCE -o OUT.tokens --tokenizer INIT_DIRECTORY")


class DataChecks:
    """A mixin of planc.lang.check's checker (its path, spans, reports and values)."""

    def _cut_by(self, data: str, init: str) -> bool:
        """Whether each data file was cut by the init checkpoint's tokenizer, as far as
        its description says; rejected at data if not."""
        from planc.data.provenance import tokenizer_mismatch

        written = self.value("train.data")
        as_written = written.sources if isinstance(written, Mixture) else \
            ((1.0, written, self.span("train.data")),)
        for (_, path), (_, name, span) in zip(blend_of(data) or ((1.0, data),), as_written):
            why = tokenizer_mismatch(path, init, name)
            if why is not None:
                self._reject(why, span, TOKENIZER_HINT)
                return False
        return True

    def _data_file(self, data: str | Mixture, model: Model | None, key: str = "train.data"
                   ) -> str | None:
        """The plan's data as planc keeps it (a resolved path, or a mixture's text,
        planc.data.blend), or None after an error."""
        if not isinstance(data, Mixture):
            return self._one_file(data, model, self.span(key))
        pairs = []
        for weight, path, span in data.sources:
            resolved = self._one_file(path, model, span)
            if resolved is None:
                return None
            pairs.append((weight, resolved))
        return blend_text(pairs)

    def _one_file(self, data: str, model: Model | None, span) -> str | None:
        from planc.data.tokens import DataError, DataMissing, check_file  # no torch

        base = os.path.dirname(os.path.abspath(self.path)) if self.path else os.getcwd()
        resolved = os.path.normpath(os.path.join(base, data))
        try:
            check_file(resolved, f"'{data}'", seq=model.seq if model else None,
                       vocab=model.vocab if model else None, scan_limit=DATA_SCAN_LIMIT)
        except DataMissing:
            self.report(warning(f"data file '{data}' does not exist (yet); planc run will need "
                                f"it", span))
        except DataError as exc:
            return self._reject(str(exc), span)
        why = vocabulary_overflow(resolved, model.vocab, data) if model else None
        if why is not None:
            return self._reject(why, span, "set the model's vocab to the tokenizer's, or "
                                "prepare the data with the model's tokenizer")
        return resolved

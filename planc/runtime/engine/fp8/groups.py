"""How an FP8 GEMM's rows meet its weights (:class:`Groups`): one weight for all, or a
rank's routed experts, each with its rows, multiplied at once and differentiated a run
of experts at a time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from planc.runtime.engine.fp8.codes import FP32
from planc.runtime.engine.fp8.tensor_cores import (bf16_pair, split_product,
                                                   split_weight_gradient)

# A backward decodes its rows (and on CUDA splits them into bf16 halves for the weight
# gradient) a run of experts at a time, each about this fraction of the rank's rows: no
# temporary of every row is alive at once (a whole experts' backward held 30 MiB more
# than an expert at a time: bench/memory_live.py's moe-fp8-zb), in a few kernels a run
# where an expert at a time would launch some for every expert.
RUNS = 8


@dataclass(frozen=True)
class Groups:
    """How a GEMM's rows meet its weights: all by one weight (no ``counts``), or a rank's
    routed experts at once, ``counts[e]`` rows of expert e one after another, each by
    slice e of stacked weights (experts x in x out). Experts run as one operation each,
    so that a rank quantises its rows (and, on FP8 tensor cores, its experts' weights)
    once a GEMM rather than once an expert: the same tiles and blocks, so the same bits
    (every group lies inside one token or one weight), in a few kernels where an expert
    at a time launched some 250 (Megatron-Core's grouped GEMM; DeepSeek-V3's DeepGEMM
    quantises fused). A backward's row-wide temporaries are made a run of experts at a
    time (:meth:`runs`), so that none is of every row; emulated, an expert's weights are
    decoded as its rows meet them, so that no fp32 copy of every expert's is made."""

    counts: tuple[int, ...] | None = None

    def spans(self) -> list[tuple[int | None, slice]]:
        """(expert, its rows) of each expert with rows; (None, all) for one weight."""
        if self.counts is None:
            return [(None, slice(None))]
        ends = itertools.accumulate(self.counts)
        return [(e, slice(end - n, end)) for e, (n, end) in enumerate(zip(self.counts, ends))
                if n]

    @staticmethod
    def weight(w: torch.Tensor, expert: int | None) -> torch.Tensor:
        """Expert ``expert``'s slice of a stack (or codes, or scales); ``w`` for None."""
        return w if expert is None else w[expert]

    def rows(self, product) -> torch.Tensor:
        """``product(expert, rows)`` of each expert's rows, one after another."""
        return side_by_side([product(e, span) for e, span in self.spans()], 0)

    def runs(self) -> list[tuple[slice, list[tuple[int | None, slice]]]]:
        """The experts with rows in runs of consecutive ones, each of about 1 /
        :data:`RUNS` of the rows (an expert's rows never split): the run's rows, and each
        expert's rows within them; one run of all for one weight."""
        if self.counts is None:
            return [(slice(None), self.spans())]
        least = max(-(-sum(self.counts) // RUNS), 1)
        runs: list[tuple[slice, list]] = []
        for e, span in self.spans():
            if not runs or runs[-1][0].stop - runs[-1][0].start >= least:
                runs.append((slice(span.start, span.start), []))
            start = runs[-1][0].start
            runs[-1] = (slice(start, span.stop),
                        [*runs[-1][1], (e, slice(span.start - start, span.stop - start))])
        return runs

    def weight_gradient(self, x, grad, shape: tuple[int, int], scaled: bool,
                        device: torch.device) -> torch.Tensor:
        """``x^T grad`` (fp32, ``shape``) over each expert's rows, stacked (zeros for an
        expert with none); over all the rows for one weight. ``x(rows)`` and
        ``grad(rows)`` give a slice of the rows in fp32, read a run at a time
        (:meth:`runs`; each row is decoded alike whatever its run, so the same bits)."""
        split = scaled and split_weight_gradient(device)
        out = self.gradient_stack(shape, device)
        for rows, spans in self.runs():
            out = self.products(out, spans, x(rows), grad(rows), split)
        return out

    def gradient_stack(self, shape: tuple[int, int], device: torch.device
                       ) -> torch.Tensor | None:
        """Zeros for every expert's weight gradient (``shape``); None for one weight."""
        return None if self.counts is None else \
            torch.zeros(len(self.counts), *shape, dtype=FP32, device=device)

    @staticmethod
    def products(out: torch.Tensor | None, spans, x_rows: torch.Tensor,
                 grad_rows: torch.Tensor, split: bool) -> torch.Tensor:
        """``x^T grad`` over each expert's ``spans`` of a run's rows (fp32), into its
        slice of ``out``; for one weight (``out`` None), the product. ``split``: as
        :func:`split_product`'s three bf16 GEMMs on tensor cores that multiply bf16 into
        fp32 (the run split once for its experts), else one fp32 GEMM."""
        x_rows, grad_rows = (t.reshape(-1, t.shape[-1]) for t in (x_rows, grad_rows))
        if split:
            x_rows, grad_rows = bf16_pair(x_rows), bf16_pair(grad_rows)
        for e, span in spans:
            if split:
                product = split_product(tuple(t[span].t() for t in x_rows),
                                        tuple(t[span] for t in grad_rows))
            elif out is not None:  # written where it goes, not made beside it
                torch.mm(x_rows[span].t(), grad_rows[span], out=out[e])
                continue
            else:
                product = x_rows[span].t() @ grad_rows[span]
            if out is None:
                return product
            out[e] = product
        return out


ONE_WEIGHT = Groups()


def side_by_side(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``parts`` joined along ``dim``; one part as it is (a cat of one copies it whole)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

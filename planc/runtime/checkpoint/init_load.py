"""Starting a run from a Hugging Face checkpoint (``train { init = "DIR" }``): every rank
fills its buckets with its slices of the transformers tensors, reading only those.

The model table says where each parameter lies in a transformers tensor
(:class:`planc.program.model_table.InitSource`, written by the compiler from the export's
own table, planc.hf.init). :class:`Part` shows such a tensor, opened with
``safetensors.safe_open(...).get_slice``, as the planc parameter it holds, so that the
resume's reader (planc.runtime.checkpoint.load) cuts each rank's tp, ep and ZeRO boxes
out of it unchanged: a rank reads exactly what its buckets hold, as with ``--resume``
(torch.distributed.checkpoint's load-time resharding; torchtitan's and Megatron-LM's HF
converters read whole tensors on every rank instead). The optimizer state starts at
zero, as in any first step.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from planc.checkpoint.manifest import CheckpointError, reason
from planc.hf.files import HFCheckpointError, check_tensors
from planc.program.model_table import InitSource
from planc.runtime.checkpoint.load import Loading
from planc.runtime.checkpoint.values import refuse_bad_values
from planc.runtime.engine.context import RankContext
from planc.runtime.engine.store import ParamStore


class Part:
    """A planc parameter inside its transformers tensors: indexed in the parameter's own
    coordinates by a tuple of slices, it reads the matching boxes of the tensors
    (``saved(name)``: a tensor indexed by slices, as safetensors' ``get_slice`` gives)."""

    def __init__(self, saved: Callable[[str], object], source: InitSource):
        self.saved, self.source = saved, source

    def get_slice(self, _name: str) -> "Part":
        return self

    def __getitem__(self, slices: tuple[slice, ...]) -> torch.Tensor:
        source = self.source
        if source.experts:  # dimension 0 picks the experts' tensors
            rows = range(*slices[0].indices(source.experts))
            return torch.stack([self._box(source.tensor.replace("{}", str(e)), slices[1:])
                                for e in rows])
        return self._box(source.tensor, slices)

    def _box(self, tensor: str, slices) -> torch.Tensor:
        swap, axis, start = self.source.swap, self.source.axis, self.source.start
        boxes = list(slices)
        if swap is not None:  # a planc dimension d is the transformers dimension swap(d)
            boxes[swap[0]], boxes[swap[1]] = boxes[swap[1]], boxes[swap[0]]
        box = boxes[axis]
        boxes[axis] = slice(box.start + start, box.stop + start)
        block = self.saved(tensor)[tuple(boxes)]
        return block.transpose(*swap) if swap is not None else block


def whole_value(saved: Callable[[str], object], source: InitSource,
                shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter's whole value (of ``shape``) from its transformers tensors, in fp32."""
    value = Part(saved, source)[tuple(slice(0, n) for n in shape)]
    return value.to(torch.float32).contiguous()


class InitialWeights(Loading):
    """A rank's reader of the model table's Hugging Face checkpoint (the resume's reader
    with the transformers tensors as its files)."""

    def __init__(self, ctx: RankContext, store: ParamStore):
        self.ctx, self.store = ctx, store
        self.world, self.rank = dist.get_world_size(), ctx.rank
        self.group = dist.new_group(list(range(self.world)), backend="gloo") \
            if self.world > 1 else None

    def load_initial(self) -> None:
        """Fill every bucket from the checkpoint; any rank's problem (a file missing or
        changed since planc check, a value that is not finite) stops every rank with one
        line."""
        from safetensors import SafetensorError, safe_open

        start = time.perf_counter()
        table = self.ctx.model.init
        base = Path(table.directory)
        where = f"Hugging Face checkpoint {base}"
        read, problem = [0], None
        try:
            stored = check_tensors(base, table.tensors)
            with ExitStack() as stack:
                opened: dict[str, object] = {}

                def saved(tensor: str):
                    file = stored[tensor].file
                    if file not in opened:
                        opened[file] = stack.enter_context(safe_open(
                            base / file, framework="pt", device="cpu"))
                    return opened[file].get_slice(tensor)

                def source(name: str) -> Part:
                    return Part(saved, table.sources[name])

                for bucket_id in sorted(self.store.buckets):
                    self._load_parameters(bucket_id, lambda m: (m["param"], m["param"], False),
                                          source, where, read)
                # the state the checkpoint holds, whole, as each rank keeps it (a
                # Mixtral checkpoint has no balancing bias: that starts at zero)
                for name, tensor in sorted(self.store.buffers.items()):
                    if name not in table.buffers:
                        continue
                    value = saved(table.buffers[name])[:].to(torch.float32)
                    refuse_bad_values(where, name, value)
                    tensor.copy_(value)
                    read[0] += value.numel() * value.element_size()
        except (HFCheckpointError, CheckpointError) as exc:
            problem = str(exc)
        except (OSError, SafetensorError) as exc:  # changed since it was checked
            problem = f"{where} cannot be read ({reason(exc)})"
        elapsed, most = self._agree(problem, time.perf_counter() - start, read[0])
        if self.rank == 0:
            print(f"planc: started from {where} in {elapsed:.3f} s (at most "
                  f"{most / 1e6:.3f} MB read by one rank)", file=sys.stderr, flush=True)

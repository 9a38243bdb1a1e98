"""An activation's output computed again in the backward rather than kept: a mixture's
experts' SwiGLU product (optimize { recompute_moe_activation }, Megatron-Core's
``recompute_modules`` "moe_act", its ``CheckpointWithoutOutput`` around the experts'
activation function), a dense MLP's SwiGLU or GELU output (optimize {
recompute_activation }, as torchtitan's per-op selective checkpointing recomputes every
operation but its matmuls and attention), and a block's two norms' outputs (optimize {
recompute_norms }, Megatron-Core's ``recompute_modules`` "layernorm"), which q/k/v and the
MLP's first GEMM read, as down reads the activation's.

The down projection's backward reads its input, the activation's output (for a routed
expert, times the routing weight), for the weight gradient. The activation's own backward
keeps its input anyway (planc.runtime.families.llama.SiluTimes and SwiGLU, GELU's autograd
node), so what the down projection keeps of the output can be how to compute it from that
input: the output's bytes go when the forward is done, one FFN-wide tensor per row less
for every microbatch in flight, for one more elementwise pass in the backward. The same
operations compute it again, so the gradients are the same bits.

Under a schedule that defers the weight gradients (zero-bubble's W, Qi et al. 2023), down's
weight half runs after the activation's input half: kept as a recipe until then, the output
would hold the activation's input, twice its size for SwiGLU. The activation's input half
makes it again instead (:meth:`Made.settle`), once, and lets the input go: the weight half
reads what it made, as it would have read the output kept.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from planc.program.operands import SEQ_AXIS
from planc.runtime.engine.model import select_tokens

# the forward steps' extra (planc.runtime.engine.kernels.Saved) under optimize {
# recompute_activation }: a dense activation's :class:`Made`, which its backward settles,
# and the same in its down projection's, whose halves hold and release it
MADE_AGAIN = "made_again"
READS_MADE = "reads_made"


def kept_as_recipe(output: torch.Tensor, compute: Callable[[], torch.Tensor]):
    """Saved-tensor hooks under which what a GEMM saves of ``output`` (the whole, or views
    of it) is kept as ``compute``, which makes it again (from tensors the activation's
    backward keeps anyway: ``compute`` holds them detached)."""
    return _hooks(_Product(compute, output))


def _hooks(source: "_Product"):
    return torch.autograd.graph.saved_tensors_hooks(source.pack, _unpacked)


class Made:
    """How to make one activation's output again (the whole, or each of tp_overlap's
    pieces), for its down projection's backward. A backward pass unpacks what the GEMM
    saved once per pass, so a split one (an input half, a weight half later) would make it
    twice: down's input half holds what it made for the weight half (:meth:`hold`),
    whose pass lets it go (:meth:`release`). The activation's own backward step, between
    the two, settles it: made now if the input half did not, and the activation's input,
    which the recipe held, let go."""

    def __init__(self):
        self.products: list[_Product] = []

    def hold(self) -> None:
        for product in self.products:
            product.held = True

    def release(self) -> None:
        for product in self.products:
            product.held = False

    def settle(self) -> None:
        for product in self.products:
            product.settle()


class Recipes:
    """A rank's dense activation or norm output that the GEMM after it has yet to read,
    with the input and the formula that make it again (optimize { recompute_activation },
    { recompute_norms }). Each runs right before its GEMM, so one is pending at a time."""

    def __init__(self):
        self._pending: tuple[torch.Tensor, torch.Tensor, Callable, Made] | None = None

    def pending(self) -> Made | None:
        """The :class:`Made` of the output yet to be read, if any."""
        return None if self._pending is None else self._pending[3]

    def remember(self, output: torch.Tensor, kept: torch.Tensor,
                 formula: Callable[[torch.Tensor], torch.Tensor]) -> Made:
        """``output`` = ``formula(kept)``, a dense activation's or a norm's (``kept``
        detached: its own backward keeps it anyway); what that backward step settles
        (:class:`Made`)."""
        made = Made()
        self._pending = (output, kept, formula, made)
        return made

    def through(self, data: torch.Tensor, gemm: Callable[[], torch.Tensor], tokens,
                frees: bool) -> torch.Tensor:
        """``gemm()`` of ``data``: where ``data`` is the pending output (an alias of it: a
        step reads its inputs as leaves of the buffers it was given), or the piece
        ``tokens`` of it (tp_overlap's pieces are copies: planc.runtime.engine.model.
        select_tokens), what the GEMM saves of ``data`` is kept as how to make it again,
        the piece alone from the piece of the input, and the piece's copy goes once the
        GEMM has read it (the step keeps it as a leaf, for its shape). With ``frees``
        (the GEMM's last piece, the output's last reader in the forward) the output's storage
        goes now: it stays the root of the activation's backward step, which reads its
        shape alone (a storage let go and the tensor kept, as ZeRO-3's gathered
        parameters, planc.runtime.engine.store). Bytes go only where the GEMM saved them
        through the recipe (hooks pushed inside hand on to it: fp8.joined_matmul)."""
        if self._pending is None:
            return gemm()
        output, kept, formula, made = self._pending
        storage = output.untyped_storage()
        piece = data.untyped_storage().data_ptr() != storage.data_ptr()
        if not piece:
            source = _Product(lambda: formula(kept), output)
        elif tokens is not None and data.shape == _piece_shape(output, tokens):
            source = _Product(lambda: formula(select_tokens(kept, *tokens)), data)
        else:  # another input: nothing to make again, and nothing kept beyond its reader
            if frees:
                self._pending = None
            return gemm()
        made.products.append(source)
        with _hooks(source):
            result = gemm()
        if piece and source.packed:  # a copy of the output's tokens, the GEMM's alone
            data.untyped_storage().resize_(0)
        if frees:
            self._pending = None
            if piece or source.packed:  # nothing else keeps the bytes
                storage.resize_(0)
        return result


def taking_anew(piece, piece_of, keep_graph: bool):
    """A GEMM's context for its input ``piece``: where it is a copy of tp_overlap's piece
    of a whole (``piece_of``: the whole, and which piece) and the GEMM keeps its graph,
    :class:`TokenPiece`; else nothing (a view of the whole, with one tp rank, holds no
    bytes of its own)."""
    if not keep_graph or piece_of is None or not isinstance(piece, torch.Tensor):
        return contextlib.nullcontext()
    whole, tokens = piece_of
    if piece.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
        return contextlib.nullcontext()
    return TokenPiece(piece, whole, tokens)


class TokenPiece:
    """A GEMM of tp_overlap's piece ``tokens`` of ``whole`` (a copy: select_tokens), saving
    the piece as how to take it of ``whole`` again: the piece's copy goes once the GEMM
    has read it, and the weight gradient takes the piece of ``whole`` anew. ``whole`` is
    kept anyway where its producer's backward keeps its output (the attention's, for
    proj's pieces), which the copies held a second time; elsewhere it is the pieces'
    bytes, kept whole instead of cut."""

    def __init__(self, piece: torch.Tensor, whole: torch.Tensor, tokens):
        whole = whole.detach()
        self.piece = piece
        self.source = _TakenAgain(lambda: select_tokens(whole, *tokens), piece)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.source.pack, _unpacked)
        self.hooks.__enter__()
        return self

    def __exit__(self, *failed):
        self.hooks.__exit__(*failed)
        if self.source.packed and not failed[0]:  # autograd kept the recipe, not the copy
            self.piece.untyped_storage().resize_(0)
        return False


def _piece_shape(output: torch.Tensor, tokens) -> torch.Size:
    """The shape of piece ``tokens`` (index, count, spread) of ``output``."""
    shape = list(output.shape)
    shape[SEQ_AXIS] //= tokens[1]
    return torch.Size(shape)


class _Product:
    """How to compute an activation's output again (a function of its inputs, detached:
    the activation's backward keeps the same tensors), and the storage its saved views
    are of. The output computed again is shared by every view a backward unpacks (one per
    expert where each runs its own GEMM) and dropped after the last of those packed."""

    def __init__(self, compute: Callable[[], torch.Tensor], product: torch.Tensor):
        self.compute: Callable[[], torch.Tensor] | None = compute
        self.storage = product.untyped_storage().data_ptr()
        self.layout = (product.shape, product.stride())
        self.packed = 0  # views saved
        self.unpacked = 0  # of them, unpacked by the backward pass now running
        self.held = False  # a later pass unpacks them again: what this one made stays
        self.whole: torch.Tensor | None = None

    def pack(self, saved: torch.Tensor):
        if saved.untyped_storage().data_ptr() != self.storage:
            return saved  # the weights, or anything else the GEMM keeps: as it is
        self.packed += 1
        return _View(self, tuple(saved.shape), saved.stride(), saved.storage_offset())

    def _made(self) -> torch.Tensor:
        if self.compute is None:
            raise RuntimeError("the activation's output is unpacked after its backward let "
                               "its input go")
        with torch.no_grad():
            whole = self.compute()
        if (whole.shape, whole.stride()) != self.layout:
            raise RuntimeError("the activation computed again is not laid out as the "
                               "forward's")
        return whole

    def settle(self) -> None:
        """Made now where a weight half yet to run will unpack it (:attr:`held`) and no
        pass made it; the tensors ``compute`` holds let go."""
        if self.held and self.whole is None:
            self.whole = self._made()
        self.compute = None

    def view(self, shape, stride, offset: int) -> torch.Tensor:
        whole = self.whole if self.whole is not None else self._made()
        self.unpacked += 1
        last = self.unpacked == self.packed  # the pass's last view: the pass is done
        if last:
            self.unpacked = 0
        self.whole = None if last and not self.held else whole
        return whole.as_strided(shape, stride, offset)


class _TakenAgain(_Product):
    """A piece of a whole's tokens taken again (TokenPiece), not computed again."""


class _View:
    __slots__ = ("source", "shape", "stride", "offset")

    def __init__(self, source: _Product, shape, stride, offset: int):
        self.source, self.shape, self.stride, self.offset = source, shape, stride, offset


def _unpacked(saved):
    if not isinstance(saved, _View):
        return saved
    return saved.source.view(saved.shape, saved.stride, saved.offset)

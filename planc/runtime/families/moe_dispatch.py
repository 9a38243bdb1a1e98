"""A mixture of experts cut at its all-to-alls (schedule { overlap_all_to_all }:
planc.passes.split_dispatch): its compute pieces, and the dispatch and combine the ep
stream runs between them.

The pieces compute what :func:`planc.runtime.families.moe.expert_parallel_mixture`
computes, in the same order, so the results are the uncut mixture's:

- the route (``moe_route``) chooses each token's experts and lays out its (token, expert)
  rows sorted by expert, each with its routing weight as a last column (DeepEP's dispatch
  carries the weights with the rows the same way), and counts the rows of every expert;
- the counts' exchange tells every rank what it will receive (:func:`exchange_counts`),
  and the dispatch sends the rows (:func:`dispatch`);
- the experts (``moe_experts``) run this rank's experts on the rows received, each
  output scaled by its weight (the product the uncut mixture forms after the combine);
- the combine returns the outputs (:func:`combine`), and the sum (``moe_combine``) adds
  each token's outputs and the shared experts' (``moe_shared``).

Between the instructions a :class:`Routed` carries the rows and what moved them: how many
rows go to and come from each member of the ep group, and each row's token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from planc.runtime.engine import fp8
from planc.runtime.families.recomputed_product import down_of_product, product_recomputed
from planc.runtime.families.moe_gate import (WithBalanceLoss, balance_loss, balanced,
                                             choose, routed_pairs, sorted_pairs)
from planc.vocabulary.model_options import balance_bias_name


@dataclass(frozen=True)
class Routed:
    """A mixture's rows between its instructions: ``rows`` (one per (token, expert)
    pair, hidden features and the routing weight), ``counts`` (the route's: rows per
    expert; after the dispatch: rows per (source member, local expert)), ``sent`` and
    ``received`` (rows to and from each member of the ep group), ``tokens`` (each row's
    token, the route's order) and the mixture's input shape."""

    rows: torch.Tensor
    counts: torch.Tensor
    tokens: torch.Tensor
    shape: tuple[int, ...]
    sent: tuple[int, ...] = ()
    received: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    experts: torch.Tensor | None = None  # each pair's expert (the route's order)
    hops: object = None  # a two-hop dispatch's planc.runtime.families.moe_two_hop.Hops

    def detach(self) -> "Routed":
        return replace(self, rows=self.rows.detach())

    def leaf(self, requires_grad: bool) -> "Routed":
        return replace(self, rows=self.rows.detach().requires_grad_(requires_grad))


def through_experts(done: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                    expert_of: torch.Tensor, local: int, experts: Experts, recipe=None,
                    again: bool = False) -> torch.Tensor:
    """``done`` with each of ``rows`` written over by its expert's output, weighted by its
    scale (:func:`expert_mlp`; ``expert_of``: each row's expert among the rank's
    ``local``). The rows are sorted by expert once (a stable sort: each expert's rows in
    their order) and each expert runs on its slice, the outputs written back at once:
    taking each expert's rows by index would zero-fill a whole gradient of the rows for
    every expert, and writing each expert's outputs would copy ``done`` whole.
    ``again``: the SwiGLU's product computed again in the backward
    (planc.runtime.families.recomputed_product)."""
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=local).tolist()
    outputs = outputs_by_expert(rows[order], scales[order], counts, experts, recipe, again)
    return done if outputs is None else copied_by_row(done, order, outputs)


def outputs_by_expert(rows: torch.Tensor, scales: torch.Tensor, counts: list[int],
                      experts: Experts, recipe=None, again: bool = False
                      ) -> torch.Tensor | None:
    """Rows in expert order, ``counts[e]`` of expert e's one after another, each through
    its expert, weighted by its scale (:func:`expert_mlp`), in the same order; None when
    no expert has rows. In the dtype the SwiGLU runs once over every expert's rows, and
    where :meth:`Experts.grouped` allows, each of the three GEMMs is one
    ``torch._grouped_mm`` over them (Megatron-Core's grouped GEMM), else a GEMM an expert:
    the same bits either way, three kernels where the loop launches three an expert. With
    FP8 each GEMM quantises every expert's rows and weights at once, then multiplies
    expert by expert (planc.runtime.engine.fp8.experts_swiglu). ``again``: the
    product not kept but computed again (planc.runtime.families.recomputed_product)."""
    if not any(counts):
        return None
    if recipe is not None:
        return fp8.experts_swiglu(rows, scales, counts, experts.gate, experts.up,
                                  experts.down, recipe)
    if experts.grouped(rows):
        ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        gate, up = (torch._grouped_mm(rows, w, offs=ends) for w in (experts.gate, experts.up))
        return down_of_product(gate, up, scales, lambda product: torch._grouped_mm(
            product, experts.down, offs=ends), again)
    gate, up, down = experts.slices()
    mine = [(expert, x) for expert, x in enumerate(rows.split(counts)) if x.shape[0]]
    return down_of_product(
        torch.cat([x @ gate[e] for e, x in mine]), torch.cat([x @ up[e] for e, x in mine]),
        scales, lambda product: torch.cat([a @ down[e] for (e, _), a in zip(
            mine, product.split([x.shape[0] for _, x in mine]))]), again)


def expert_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               recipe=None, scale: torch.Tensor | None = None, again: bool = False
               ) -> torch.Tensor:
    """A routed or shared expert's SwiGLU of rows ``x``: in ``x``'s dtype, or by FP8
    ``recipe`` with DeepSeek-V3's storage, the SwiGLU's inputs kept in FP8 and its output
    recomputed (planc.runtime.engine.fp8.experts_swiglu). ``scale`` (rows x 1): a routed
    expert's routing weights, applied inside the SwiGLU, before the down projection
    (Megatron-Core's weighted SwiGLU): the weighted output, with nothing hidden wide
    kept for the weights' gradient, which the SwiGLU's own inputs give. ``again``: the
    product computed again in the backward (planc.runtime.families.recomputed_product)."""
    if recipe is None:
        return down_of_product(x @ gate, x @ up, scale, lambda product: product @ down, again)
    return fp8.experts_swiglu(x, scale, None, gate, up, down, recipe)


class _PutByRow(torch.autograd.Function):
    """``values`` put into ``into`` at ``rows``: added (``into.index_add(0, rows,
    values)``), group after group of ``groups`` rows where given, or written over
    (``index_copy``). Its backward reads the indices alone (each value's gradient is its
    row's; ``into``'s is the gradient, zero where a row was written over), where
    autograd's index_add and index_copy keep ``values`` too (hidden-wide rows, for their
    shape alone); autograd's operations, so the same bits."""

    @staticmethod
    def forward(ctx, into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                add: bool, groups: list[int] | None = None) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.add = add
        if not add:
            return into.index_copy(0, rows, values)
        if groups is None:
            return into.index_add(0, rows, values)
        out = into.clone()
        for index, group in zip(rows.split(groups), values.split(groups)):
            out.index_add_(0, index, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        into = grad if ctx.add else grad.index_fill(0, rows, 0)
        return into, None, grad.index_select(0, rows), None, None


def added_by_token(into: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                   groups: list[int] | None = None) -> torch.Tensor:
    """Each of ``rows`` added to its token's row of ``into`` (a token's experts' outputs
    summed, in the rows' order); ``groups``: the sizes of groups of rows with a token at
    most once each (an expert's), added one group after another, so that a token's
    sum has one order on every device (one index_add of rows with repeated tokens adds
    them in any order on a GPU)."""
    return _PutByRow.apply(into, tokens, rows, True, groups)


def copied_by_row(into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
                  ) -> torch.Tensor:
    """Each of ``values`` written over its row of ``into`` (an expert's outputs among the
    experts piece's)."""
    return _PutByRow.apply(into, rows, values, False, None)


@dataclass(frozen=True)
class Experts:
    """The gate, up and down weights of a block's routed experts (a rank's), each stacked
    (experts x in x out)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def slices(self) -> tuple:
        """Each weight as its experts' slices (``unbind``): the backward stacks the slices'
        gradients once, where indexing the parameter expert by expert would return a
        whole zero-filled gradient of it for every expert, summed (as many times the
        memory traffic as the rank has experts)."""
        return tuple(w.unbind(0) for w in (self.gate, self.up, self.down))

    def grouped(self, rows: torch.Tensor) -> bool:
        """Whether ``torch._grouped_mm`` takes these weights and ``rows`` (hidden wide):
        every row a multiple of 16 bytes, as its check of strides asks, and on a GPU
        every tensor's start 16-byte aligned. On a GPU, only where it is one grouped
        GEMM, in bf16 on Hopper and Blackwell (compute capability 9 and 10; Megatron-Core's
        and torchtitan's routed experts); on a CPU torch loops over the experts' GEMMs
        as :func:`outputs_by_expert` would, to the same bits (tests/test_moe.py)."""
        if not hasattr(torch, "_grouped_mm") or rows.dim() != 2:
            return False
        if rows.is_cuda and (rows.dtype != torch.bfloat16 or
                             torch.cuda.get_device_capability(rows.device)[0] not in (9, 10)):
            return False
        tensors = (rows, self.gate, self.up, self.down)
        return all(t.dtype == rows.dtype and t.is_contiguous()
                   and t.shape[-1] * t.element_size() % 16 == 0
                   and (t.device.type == "cpu" or t.data_ptr() % 16 == 0) for t in tensors)


def stacked_experts(weights_of) -> Experts:
    """The block's routed experts' weights (this rank's), by ``weights_of(name)``."""
    return Experts(*(weights_of(f"experts.{w}.weight") for w in ("gate", "up", "down")))


def gate_hooks(k, spec, step: int, mb: int) -> tuple:
    """(bias, count, drops) of a mixture's gate in step ``step``, microbatch ``mb``
    (planc.runtime.families.moe_gate.choose and routed_pairs): the balancing bias the last
    update left and where this step's choices are counted (None without bias_update or
    when nothing counts them, as in an evaluation), and where capacity's drops are told
    (the metrics'); a recomputed forward overwrites its own entries."""
    bias = count = None
    if balanced(k.ctx.model):
        bias = k.buffers[balance_bias_name(spec.layer)]
        if k.chosen is not None:
            count = lambda per_expert: k.chosen.__setitem__(  # noqa: E731
                (step, mb, spec.layer), per_expert)
    drops = lambda dropped, pairs: k.dropped.__setitem__(  # noqa: E731
        (step, mb, spec.layer), (dropped, pairs))
    return bias, count, drops


def route(k, spec, x, p, step, mb, extra):
    """The route piece: the rows to dispatch (its autograd output, with the balance loss
    joined to it), and a :class:`Routed` for the transfers (``extra["report"]``)."""
    data = x["x"]
    m = k.ctx.model
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    weights_of = lambda name: p(by_suffix[name])  # noqa: E731
    tokens = data.reshape(-1, data.shape[-1])
    bias, count, drops = gate_hooks(k, spec, step, mb)
    probabilities, experts, weights = choose(tokens, weights_of, m, bias, count)
    chosen = routed_pairs(experts, data.shape[0], k.positions(spec), m, spec.counts,
                          drops).reshape(-1)
    order, token_of = sorted_pairs(chosen, m.top_k)
    counts = torch.bincount(chosen[order], minlength=m.experts)
    rows = torch.cat([tokens[token_of],
                      weights.reshape(-1)[order].to(tokens.dtype).unsqueeze(-1)], dim=1)
    if m.aux_loss:
        rows = WithBalanceLoss.apply(
            rows, balance_loss(probabilities, experts, data.shape[0], m, spec.counts)
            / m.batch)
    extra["report"] = Routed(rows, counts, token_of, tuple(data.shape),
                             experts=chosen[order])
    return rows


def exchange_rows(values: torch.Tensor, sent, received, group) -> torch.Tensor:
    """Rows to the ranks of ``group``, ``sent[j]`` of them to member j, ``received[j]``
    from it (all_to_all_single with uneven splits)."""
    out = values.new_empty((sum(received), *values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), list(received), list(sent), group=group)
    return out


def exchange_sizes(counts: torch.Tensor, group) -> torch.Tensor:
    """Equal shares of ``counts`` to the ranks of ``group`` (each rank's sizes for each
    member), theirs back."""
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts.contiguous(), group=group)
    return arriving


def exchange_fp8_rows(features: torch.Tensor, sent, received, group, recipe,
                      gradients: bool = False) -> torch.Tensor:
    """:func:`exchange_rows` of ``features``, as FP8 with ``recipe`` (DeepSeek-V3, section
    3.3.4: E4M3 bytes and a scale per tile; ``gradients``: in the recipe's format of
    output gradients, which the GEMM that reads them quantises to), decoded on arrival
    into their dtype."""
    if recipe is None:
        return exchange_rows(features, sent, received, group)
    return decoded(exchange_encoded(features, sent, received, group, recipe, gradients),
                   features.shape[1], features.dtype)


def exchange_gradients(grads: torch.Tensor, sent, received, group, recipe):
    """The combine's gradients to the experts: :func:`exchange_rows`, or with ``recipe``
    in FP8 as :func:`exchange_fp8_rows` sends them, kept encoded on arrival
    (planc.runtime.engine.fp8.EncodedRows) for the experts' backward to decode."""
    if recipe is None:
        return exchange_rows(grads, sent, received, group)
    return fp8.EncodedRows(*exchange_encoded(grads, sent, received, group, recipe, True),
                           grads.shape[1], grads.dtype)


def exchange_encoded(features: torch.Tensor, sent, received, group, recipe,
                     gradients: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``features`` encoded as FP8 with ``recipe`` (E4M3, or ``gradients`` in the
    recipe's format of output gradients) and sent as :func:`exchange_codes` sends them,
    still encoded on arrival."""
    form = recipe.gradients if gradients else fp8.E4M3
    return exchange_codes(fp8.encoded_rows(features, recipe.tile, form), sent, received,
                          group)


def exchange_codes(encoded: tuple[torch.Tensor, torch.Tensor], sent, received, group
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows encoded as FP8 (planc.runtime.engine.fp8.encoded_rows: E4M3 codes and a
    scale a tile) to the ranks of a group as :func:`exchange_rows` sends rows, still
    encoded: a two-hop gateway forwards the bytes it received, as DeepEP does."""
    codes, scale = encoded
    tiles, tile = codes.shape[1], codes.shape[2]
    # every width given whole: a rank may send or receive no rows
    codes_in = exchange_rows(codes.view(torch.uint8).reshape(codes.shape[0], tiles * tile),
                             sent, received, group)
    scales_in = exchange_rows(scale.reshape(scale.shape[0], tiles), sent, received, group)
    return codes_in.view(codes.dtype).reshape(codes_in.shape[0], tiles, tile), \
        scales_in.reshape(scales_in.shape[0], tiles, 1)


def decoded(encoded: tuple[torch.Tensor, torch.Tensor], features: int, dtype
            ) -> torch.Tensor:
    """FP8 rows (:func:`exchange_codes`) in ``dtype``, ``features`` wide."""
    return fp8.decoded_rows(*encoded, features).to(dtype)


def exchanged_counts(per_expert: torch.Tensor, group, ep: int
                     ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The all-to-all of the rows this rank sends each expert (``per_expert``, sorted by
    expert, experts / ep to each of the ep members): (the rows each member sends each of
    this rank's experts, ep x experts / ep; the rows sent to each member; the rows
    received from each)."""
    per_rank = per_expert.numel() // ep
    arriving = exchange_sizes(per_expert, group).reshape(ep, per_rank)
    return (arriving, tuple(per_expert.reshape(ep, per_rank).sum(1).tolist()),
            tuple(arriving.sum(1).tolist()))


def received_experts(arriving: torch.Tensor) -> torch.Tensor:
    """Each received row's expert among this rank's: each member's rows come sorted by
    expert, ``arriving`` (:func:`exchanged_counts`) of each."""
    members, local = arriving.shape
    return torch.repeat_interleave(
        torch.arange(local, device=arriving.device).repeat(members), arriving.reshape(-1))


def exchange_counts(routed: Routed, group, members: tuple[int, ...]) -> Routed:
    """The counts per expert over the group: each rank learns the rows each member will
    send to each of its experts (the rows themselves stay here until the dispatch)."""
    arriving, sent, received = exchanged_counts(routed.counts, group, len(members))
    return replace(routed, counts=arriving, sent=sent, received=received, members=members)


def dispatch(routed: Routed, group, recipe=None) -> Routed:
    """The forward dispatch of the rows the counts' exchange sized, as FP8 with
    ``recipe`` (DeepSeek-V3, section 3.3.4: the hidden features as E4M3 and a scale per
    tile, the weights in the dtype)."""
    sent, received = routed.sent, routed.received
    if recipe is None:
        return replace(routed, rows=exchange_rows(routed.rows, sent, received, group))
    features, weights = routed.rows[:, :-1], routed.rows[:, -1:]
    return replace(routed, rows=torch.cat([
        exchange_fp8_rows(features, sent, received, group, recipe),
        exchange_rows(weights, sent, received, group)], dim=1))


def exchange(values: torch.Tensor, routing: Routed, outbound: bool, group
             ) -> torch.Tensor:
    """Rows to the ranks as the dispatch moved them (``outbound``: the forward dispatch's
    way, which the combine's gradients take too) or back (the combine, the dispatch's
    gradients)."""
    if outbound:
        return exchange_rows(values, routing.sent, routing.received, group)
    return exchange_rows(values, routing.received, routing.sent, group)


def experts(k, spec, x, p, step, mb, extra):
    """This rank's experts on the rows dispatched to them, each weighted inside its
    SwiGLU (:func:`expert_mlp`)."""
    routed: Routed = x["x"]
    m = k.ctx.model
    rows = routed.rows
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    stacked = stacked_experts(lambda name: p(by_suffix[name]))
    local = routed.counts.shape[1]
    expert_of = received_experts(routed.counts)
    k.routed[(step, mb, spec.layer)] = (rows.shape[0], routed.members)
    features, weights = rows[:, :-1], rows[:, -1:]
    recipe = fp8.recipe_of(m)
    # zeros that depend on the rows: a rank whose experts got none still runs the
    # backward, whose all-to-alls its peers wait for
    done = through_experts(features * 0, features, weights, expert_of, local, stacked, recipe,
                           product_recomputed(m))
    if spec.drops_rows:
        _let_go_of_decoded(rows)
    return done


def _let_go_of_decoded(rows: torch.Tensor) -> None:
    """The received rows' bytes go, where the program says so (``drops_rows``: a cut
    mixture's experts with model { fp8 }, whose backward reads FP8 codes of their rows,
    gate and up, planc.runtime.engine.fp8, and copies of their routing weights, and after
    which the combine and the sum read the routing alone). The tensor stays, what the
    backward differentiates to, as ZeRO-3's let-go buckets do
    (planc.runtime.engine.store). On a GPU the rows came on the ep stream and the
    experts' kernels that read them may still be queued on this one: recorded on it
    first, so that the caching allocator hands their block out again only once they are
    done."""
    if rows.is_cuda:
        rows.record_stream(torch.cuda.current_stream())
    rows.untyped_storage().resize_(0)


def shared(k, spec, x, p, step, mb, extra):
    """The shared experts on the mixture's tokens (flattened), as the uncut one adds
    them."""
    data = x["x"]
    by_suffix = {name.split(".", 2)[-1]: name for name in spec.params}
    return expert_mlp(data.reshape(-1, data.shape[-1]),
                      *(p(by_suffix[f"shared.{w}.weight"]) for w in ("gate", "up", "down")),
                      fp8.recipe_of(k.ctx.model), again=product_recomputed(k.ctx.model))


def total(k, spec, x, p, step, mb, extra):
    """Each token's weighted outputs added up (in the route's order), then the shared
    experts'."""
    rows, routing = x["x"], x["routing"]
    shape = routing.shape
    out = added_by_token(rows.new_zeros((shape[0] * shape[1], shape[2])), routing.tokens,
                         rows)
    if "shared" in x:
        out = out + x["shared"]
    return out.reshape(shape)

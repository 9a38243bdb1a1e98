"""A cut mixture's dispatch and combine in two hops (``optimize { moe_dispatcher =
two_hop }``: DeepSeek-V3's dispatch, section 3.2.2, which DeepEP later released): a token
crosses the inter-node link once per node that holds one of its experts, to the rank of
that node at its own place on the node (its gateway), and the gateway forwards it over
NVLink once per rank that holds one of its experts, with each of its pairs' expert and
weight beside it (DeepEP's ``topk_idx`` and ``topk_weights``); the rank copies the row to
its pairs. The combine runs the hops back: a rank adds a token's weighted outputs of its
experts, the gateway adds them on its node, before each crosses back.

Both hops are all-to-alls over the whole ep group in which a rank sends only to its
gateways (hop 1) or to the ranks of its node (hop 2), the other splits empty. On one node
every gateway is the rank itself, and with one rank a node every hop 2 stays on it: such
a hop moves nothing and runs no collective (the whole group knows it alike). Each map is
linear in the rows, so each backward is written out: the same hops reversed, a sum where
the forward copied and a copy where it summed. A token's pairs on one node are one row,
so the gradient of the route's rows is that row's gradient on one of its pairs (the
first) and zero on the others: the route's gather adds them up to the same token
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planc.runtime.engine import fp8
from planc.runtime.families.moe_dispatch import (decoded, exchange_codes, exchange_encoded,
                                                 exchange_rows, exchange_sizes)

INDEX = torch.int64


@dataclass(frozen=True)
class Hop:
    """One hop's exchanges over the ep ``group``; ``local`` where every rank sends only
    to itself (one node for hop 1, one rank a node for hop 2), which then moves nothing."""

    group: object
    local: bool

    def rows(self, values: torch.Tensor, sent, received) -> torch.Tensor:
        return values if self.local else exchange_rows(values, sent, received, self.group)

    def sizes(self, counts: torch.Tensor) -> torch.Tensor:
        return counts if self.local else exchange_sizes(counts, self.group)

    def encoded(self, rows: torch.Tensor, sent, received, recipe, gradients: bool = False):
        """``rows`` as FP8 codes and scales with ``recipe`` (E4M3, or gradients in the
        recipe's format for them), still encoded on arrival for the gateway to forward."""
        if self.local:
            form = recipe.gradients if gradients else fp8.E4M3
            return fp8.encoded_rows(rows, recipe.tile, form)
        return exchange_encoded(rows, sent, received, self.group, recipe, gradients)

    def codes(self, encoded, sent, received):
        return encoded if self.local else exchange_codes(encoded, sent, received, self.group)


@dataclass(frozen=True)
class Hops:
    """What the two hops of one microbatch's dispatch moved, on this rank as a source of
    tokens, as a gateway and as an experts' rank, for its combine and the backward."""

    hop1: Hop
    hop2: Hop
    order1: torch.Tensor  # the route's pairs in hop 1's order (by node, token, expert)
    row_of_pair: torch.Tensor  # each pair's hop-1 row (in the route's order)
    first: torch.Tensor  # the pair that carries its hop-1 row's gradient (route's order)
    tokens1: torch.Tensor  # each hop-1 row's token, in hop 1's order
    sent1: tuple[int, ...]  # hop-1 rows to each member, and from each
    received1: tuple[int, ...]
    pairs_sent1: tuple[int, ...]  # hop-1 pairs to each member, and from each
    pairs_received1: tuple[int, ...]
    order2: torch.Tensor  # as a gateway: the received pairs in hop 2's order (rank, expert)
    sent2: tuple[int, ...]  # hop-2 pairs to each member, and from each
    received2: tuple[int, ...]
    rows2: torch.Tensor  # as a gateway: each hop-2 row's received hop-1 row
    rows_sent2: tuple[int, ...]  # hop-2 rows (one per token and rank) to each member
    rows_received2: tuple[int, ...]
    row2_of_pair: torch.Tensor  # as an experts' rank: each received pair's hop-2 row


def dispatch(rows: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor,
             node_of: tuple[int, ...], index: int, per_rank: int, group, recipe=None
             ) -> tuple[torch.Tensor, torch.Tensor, Hops]:
    """The forward dispatch of the route's ``rows`` (one per pair, features and weight,
    sorted by expert), ``experts`` and ``tokens`` of each pair, over the ep group whose
    member j sits on node ``node_of[j]``; this rank is member ``index``. Returns the rows
    this rank's experts receive, one per pair (by source member, then expert), the
    counts of those rows per (source member, local expert), and what the hops moved."""
    ep = len(node_of)
    nodes = sorted(set(node_of))
    hop1 = Hop(group, len(nodes) == 1)
    hop2 = Hop(group, len(nodes) == ep)
    place = [sum(1 for k in range(j) if node_of[k] == node_of[j]) for j in range(ep)]
    gateway = {node_of[j]: j for j in range(ep) if place[j] == place[index]}
    member = experts // per_rank
    device = rows.device  # every index on the rows' device (the NCCL backend's GPU)
    node = torch.tensor(node_of, dtype=INDEX, device=device)[member]
    # hop 1: one row per (node, token), to this rank's gateway on that node
    key = (node * (int(tokens.max()) + 1 if tokens.numel() else 1) + tokens)
    order1 = torch.sort(key * (int(experts.max()) + 1 if experts.numel() else 1) + experts,
                        stable=True).indices
    unique, row_in_order = torch.unique_consecutive(key[order1], return_inverse=True)
    rows1_first = torch.zeros(unique.numel(), dtype=INDEX, device=device).scatter_reduce(
        0, row_in_order, torch.arange(order1.numel(), device=device), "amin",
        include_self=False)
    tokens1 = tokens[order1][rows1_first]
    node1 = node[order1][rows1_first]
    row_of_pair = torch.empty_like(order1)
    row_of_pair[order1] = row_in_order
    first = torch.zeros(order1.numel(), dtype=torch.bool, device=device)
    first[order1[rows1_first]] = True
    to_member = torch.zeros(ep, dtype=INDEX, device=device)
    pairs_to = torch.zeros(ep, dtype=INDEX, device=device)
    for n in nodes:
        to_member[gateway[n]] = int((node1 == n).sum())
        pairs_to[gateway[n]] = int((node[order1] == n).sum())
    sizes = hop1.sizes(torch.stack([to_member, pairs_to], 1))
    sent1, pairs_sent1 = tuple(to_member.tolist()), tuple(pairs_to.tolist())
    received1, pairs_received1 = tuple(sizes[:, 0].tolist()), tuple(sizes[:, 1].tolist())
    features = rows[:, :-1][order1[rows1_first]]
    received_rows = hop1.rows(features, sent1, received1) if recipe is None else \
        hop1.encoded(features, sent1, received1, recipe)
    # each pair: its row within its node's hop-1 rows, its expert, its weight
    start1 = _starts(to_member)
    gateway_of_node = torch.zeros(max(nodes) + 1, dtype=INDEX, device=device)
    for n, j in gateway.items():
        gateway_of_node[n] = j
    local_row = row_in_order - start1[gateway_of_node[node[order1]]]
    meta, weights = _unpacked(hop1.rows(_packed(
        torch.stack([local_row, experts[order1]], 1), rows[:, -1:][order1]), pairs_sent1,
        pairs_received1), 2, rows.dtype)
    # as a gateway: each pair's row among those received, then hop 2 over the node, a
    # row per (token, rank) and each pair's place among them
    gateway_rows = meta[:, 0] + _starts(torch.tensor(received1, device=device))[
        _senders(pairs_received1, device)]
    expert2 = meta[:, 1]
    order2 = torch.sort(expert2, stable=True).indices  # by member, then expert
    member2 = expert2 // per_rank
    sent2 = torch.bincount(member2, minlength=ep)
    width = sum(received1) + 1
    unique2, row2_at_gateway = torch.unique(member2 * width + gateway_rows,
                                            return_inverse=True)
    rows2 = unique2 % width
    rows_sent2 = torch.bincount(unique2 // width, minlength=ep)
    start2 = _starts(rows_sent2)
    per_expert = torch.bincount(expert2, minlength=ep * per_rank).reshape(ep, per_rank)
    arriving = hop2.sizes(torch.cat([per_expert, rows_sent2.unsqueeze(1)], 1))
    counts, rows_received2 = arriving[:, :per_rank], tuple(arriving[:, per_rank].tolist())
    received2 = tuple(counts.sum(1).tolist())
    sent2, rows_sent2 = tuple(sent2.tolist()), tuple(rows_sent2.tolist())
    place2, weights2 = _unpacked(hop2.rows(_packed(
        (row2_at_gateway - start2[member2])[order2].unsqueeze(1), weights[order2]), sent2,
        received2), 1, rows.dtype)
    place2 = place2.squeeze(1)
    row2_of_pair = place2 + _starts(torch.tensor(rows_received2, device=device))[
        _senders(received2, device)]
    hops = Hops(hop1, hop2, order1, row_of_pair, first, tokens1, sent1, received1,
                pairs_sent1, pairs_received1, order2, sent2, received2, rows2, rows_sent2,
                rows_received2, row2_of_pair)
    forwarded = _forwarded(received_rows, hops, recipe, features)
    return torch.cat([forwarded[row2_of_pair], weights2], 1), counts, hops


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each member's block begins in rows laid out member by member, ``counts``
    rows each (the exclusive prefix sum)."""
    return torch.cumsum(counts, 0) - counts


def _senders(received: tuple[int, ...], device) -> torch.Tensor:
    """Each received row's sending member, ``received[j]`` rows from member j."""
    return torch.repeat_interleave(torch.arange(len(received), device=device),
                                   torch.tensor(received, device=device))


def _packed(indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A pair's indices and its weight as one float64 row, so that one exchange moves
    them (float64 holds an index below 2^53 and a weight of any narrower float exactly,
    as DeepEP sends topk_idx and topk_weights with the rows)."""
    return torch.cat([indices.to(torch.float64), weights.to(torch.float64)], 1)


def _unpacked(packed: torch.Tensor, indices: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_packed` packed: ``indices`` columns of indices, then the weight."""
    return packed[:, :indices].to(INDEX), packed[:, indices:].to(dtype)


def combine(outputs: torch.Tensor, hops: Hops) -> torch.Tensor:
    """The forward combine: the experts' outputs added per hop-2 row on their rank, back
    over the node, added per hop-1 row at the gateway, and back over the network: one
    row per hop-1 row, in hop 1's order."""
    per_rank = outputs.new_zeros((sum(hops.rows_received2), outputs.shape[1])).index_add(
        0, hops.row2_of_pair, outputs)
    back = hops.hop2.rows(per_rank, hops.rows_received2, hops.rows_sent2)
    summed = back.new_zeros((sum(hops.received1), back.shape[1])).index_add(
        0, hops.rows2, back)
    return hops.hop1.rows(summed, hops.received1, hops.sent1)


def combine_backward(grads: torch.Tensor, hops: Hops, recipe=None):
    """The gradients of the combine's hop-1 rows to the experts' outputs: copied to every
    hop-2 row of a hop-1 row at its gateway and to every pair of a hop-2 row on the
    experts' rank (where the forward added them); as FP8 with ``recipe`` over both hops,
    as the dispatch sends its rows (DeepSeek-V3, section 3.3: the activation gradient
    before the down-projections), and kept so on arrival
    (planc.runtime.engine.fp8.EncodedRows) for the experts' backward to decode."""
    if recipe is None:
        at_gateway = hops.hop1.rows(grads, hops.sent1, hops.received1)
        return _forwarded(at_gateway, hops, recipe, grads)[hops.row2_of_pair]
    at_gateway = hops.hop1.encoded(grads, hops.sent1, hops.received1, recipe, gradients=True)
    codes, scales = _forwarded_codes(at_gateway, hops)
    return fp8.EncodedRows(codes[hops.row2_of_pair], scales[hops.row2_of_pair],
                           grads.shape[1], grads.dtype)


def _forwarded(arrived, hops: Hops, recipe, like: torch.Tensor) -> torch.Tensor:
    """Hop 2: the gateway's hop-2 rows of what hop 1 brought to the experts' ranks on
    its node, one per (token, rank); with ``recipe`` the FP8 bytes forwarded as they came
    (DeepEP forwards them so, and the experts read what one quantisation left), decoded
    there into the features and dtype of ``like``, what hop 1 sent."""
    if recipe is None:
        return hops.hop2.rows(arrived[hops.rows2], hops.rows_sent2, hops.rows_received2)
    return decoded(_forwarded_codes(arrived, hops), like.shape[1], like.dtype)


def _forwarded_codes(arrived, hops: Hops):
    """Hop 2 of FP8 rows (codes and scales) as they came to the gateway, still encoded."""
    codes, scales = arrived
    return hops.hop2.codes((codes[hops.rows2], scales[hops.rows2]), hops.rows_sent2,
                           hops.rows_received2)


def dispatch_backward(grads: torch.Tensor, hops: Hops, pairs: int) -> torch.Tensor:
    """The gradients of the experts' rows to the route's ``pairs`` rows: the features
    added per hop-2 row on the experts' rank and per hop-1 row at the gateway (where the
    forward copied them), back over the node and the network; each row's gradient to its
    first pair, each weight's gradient to its pair."""
    rows1 = combine(grads[:, :-1], hops)  # the forward combine's map: the same sums
    weights_back = hops.hop2.rows(grads[:, -1:], hops.received2, hops.sent2)
    in_order = torch.empty_like(weights_back)
    in_order[hops.order2] = weights_back
    weights = hops.hop1.rows(in_order, hops.pairs_received1, hops.pairs_sent1)
    out = grads.new_zeros((pairs, grads.shape[1]))
    out[:, :-1] = rows1[hops.row_of_pair] * hops.first.unsqueeze(-1).to(grads.dtype)
    out[hops.order1, -1:] = weights
    return out

"""A cut mixture's dispatch and combine in two hops (``optimize { moe_dispatcher =
two_hop }`` where the ep group spans nodes: DeepSeek-V3's dispatch, section 3.2.2, which
DeepEP later released): a token crosses the inter-node link once per node that holds one
of its experts, to the rank of that node at its own place on the node (its gateway), and
the gateway forwards one row per (token, expert) over NVLink to the experts' ranks. The
combine runs the hops back, and the gateway adds a token's outputs on its node before
they cross the network.

Both hops are all-to-alls over the whole ep group in which a rank sends only to its
gateways (hop 1) or to the ranks of its node (hop 2), the other splits empty. Each map is
linear in the rows, so each backward is written out: the same hops reversed, a sum where
the forward copied and a copy where it summed. A token's rows to one node are one row,
so the gradient of the route's rows is that row's gradient on one of its pairs (the
first) and zero on the others: the route's gather adds them up to the same token
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planc.runtime.families.moe_dispatch import (decoded, exchange_codes, exchange_encoded,
                                                 exchange_rows, exchange_sizes)

INDEX = torch.int64


@dataclass(frozen=True)
class Hops:
    """What the two hops of one microbatch's dispatch moved, on this rank as a source of
    tokens and as a gateway, for its combine and the backward."""

    order1: torch.Tensor  # the route's pairs in hop 1's order (by node, token, expert)
    row_of_pair: torch.Tensor  # each pair's hop-1 row (in the route's order)
    first: torch.Tensor  # the pair that carries its hop-1 row's gradient (route's order)
    tokens1: torch.Tensor  # each hop-1 row's token, in hop 1's order
    sent1: tuple[int, ...]  # hop-1 rows to each member, and from each
    received1: tuple[int, ...]
    pairs_sent1: tuple[int, ...]  # hop-1 pairs to each member, and from each
    pairs_received1: tuple[int, ...]
    gateway_rows: torch.Tensor  # as a gateway: each received pair's received hop-1 row
    order2: torch.Tensor  # the received pairs in hop 2's order (by rank, expert)
    sent2: tuple[int, ...]
    received2: tuple[int, ...]


def dispatch(rows: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor,
             node_of: tuple[int, ...], index: int, per_rank: int, group, recipe=None
             ) -> tuple[torch.Tensor, torch.Tensor, Hops]:
    """The forward dispatch of the route's ``rows`` (one per pair, features and weight,
    sorted by expert), ``experts`` and ``tokens`` of each pair, over the ep group whose
    member j sits on node ``node_of[j]``; this rank is member ``index``. Returns the rows
    this rank's experts receive (by source member, then expert), the counts of those
    rows per (source member, local expert), and what the hops moved."""
    ep = len(node_of)
    nodes = sorted(set(node_of))
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
    sizes = exchange_sizes(torch.stack([to_member, pairs_to], 1), group)
    sent1, pairs_sent1 = tuple(to_member.tolist()), tuple(pairs_to.tolist())
    received1, pairs_received1 = tuple(sizes[:, 0].tolist()), tuple(sizes[:, 1].tolist())
    features = rows[:, :-1][order1[rows1_first]]
    received_rows = _hop(features, sent1, received1, group, recipe)
    # each pair: its row within its node's hop-1 rows, its expert, its weight
    start1 = torch.cumsum(to_member, 0) - to_member
    gateway_of_node = torch.zeros(max(nodes) + 1, dtype=INDEX, device=device)
    for n, j in gateway.items():
        gateway_of_node[n] = j
    local_row = row_in_order - start1[gateway_of_node[node[order1]]]
    meta = exchange_rows(torch.stack([local_row, experts[order1]], 1), pairs_sent1,
                       pairs_received1, group)
    weights = exchange_rows(rows[:, -1:][order1], pairs_sent1, pairs_received1, group)
    # as a gateway: each pair's row among those received, then hop 2 over the node
    source = torch.repeat_interleave(torch.arange(ep, device=device),
                                     torch.tensor(pairs_received1, device=device))
    arrived = torch.tensor(received1, device=device)
    offset = torch.cumsum(arrived, 0) - arrived
    gateway_rows = meta[:, 0] + offset[source]
    expert2 = meta[:, 1]
    order2 = torch.sort(expert2, stable=True).indices  # by member, then expert
    member2 = expert2[order2] // per_rank
    sent2 = tuple(torch.bincount(member2, minlength=ep).tolist())
    per_expert = torch.bincount(expert2, minlength=ep * per_rank).reshape(ep, per_rank)
    arriving = exchange_sizes(per_expert, group)
    received2 = tuple(arriving.sum(1).tolist())
    at = gateway_rows[order2]
    if recipe is None:  # the features and their weights in one exchange
        out = exchange_rows(torch.cat([received_rows[at], weights[order2]], 1), sent2,
                            received2, group)
    else:
        out = torch.cat([_forwarded(received_rows, at, sent2, received2, group, recipe,
                                    features),
                         exchange_rows(weights[order2], sent2, received2, group)], 1)
    return out, arriving, Hops(order1, row_of_pair, first, tokens1, sent1, received1,
                               pairs_sent1, pairs_received1, gateway_rows, order2, sent2,
                               received2)


def combine(outputs: torch.Tensor, hops: Hops, group) -> torch.Tensor:
    """The forward combine: the experts' outputs back over the node, added per hop-1 row
    at the gateway, and back over the network: one row per hop-1 row, in hop 1's order."""
    back = exchange_rows(outputs, hops.received2, hops.sent2, group)
    pairs = torch.empty_like(back)
    pairs[hops.order2] = back
    summed = back.new_zeros((sum(hops.received1), back.shape[1])).index_add(
        0, hops.gateway_rows, pairs)
    return exchange_rows(summed, hops.received1, hops.sent1, group)


def combine_backward(grads: torch.Tensor, hops: Hops, group, recipe=None) -> torch.Tensor:
    """The gradients of the combine's hop-1 rows to the experts' outputs: copied to every
    pair of a row at its gateway (where the forward added them); as FP8 with ``recipe``
    over both hops, as the dispatch sends its rows (DeepSeek-V3, section 3.3: the
    activation gradient before the down-projections)."""
    at_gateway = _hop(grads, hops.sent1, hops.received1, group, recipe, gradients=True)
    return _forwarded(at_gateway, hops.gateway_rows[hops.order2], hops.sent2,
                      hops.received2, group, recipe, grads)


def _hop(rows: torch.Tensor, sent, received, group, recipe, gradients: bool = False):
    """Hop 1: ``rows`` to the gateways, as FP8 codes and scales with ``recipe`` (E4M3, or
    gradients in the recipe's format for them; still encoded on arrival, for the gateway
    to forward), else as they are."""
    if recipe is None:
        return exchange_rows(rows, sent, received, group)
    return exchange_encoded(rows, sent, received, group, recipe, gradients)


def _forwarded(arrived, rows: torch.Tensor, sent, received, group, recipe,
               like: torch.Tensor) -> torch.Tensor:
    """Hop 2: the gateway's ``rows`` of what hop 1 brought (:func:`_hop`) to the
    experts' ranks on its node; with ``recipe`` the FP8 bytes forwarded as they came
    (DeepEP forwards them so, and the experts read what one quantisation left), decoded
    there into the features and dtype of ``like``, what hop 1 sent."""
    if recipe is None:
        return exchange_rows(arrived[rows], sent, received, group)
    codes, scales = arrived
    return decoded(exchange_codes((codes[rows], scales[rows]), sent, received, group),
                   like.shape[1], like.dtype)


def dispatch_backward(grads: torch.Tensor, hops: Hops, pairs: int, group
                      ) -> torch.Tensor:
    """The gradients of the experts' rows to the route's ``pairs`` rows: back over the
    node, the features added per hop-1 row at the gateway (where the forward copied
    them), back over the network; each row's gradient to its first pair, each weight's
    gradient to its pair."""
    back = exchange_rows(grads, hops.received2, hops.sent2, group)
    in_order = torch.empty_like(back)
    in_order[hops.order2] = back
    features = in_order[:, :-1]
    summed = features.new_zeros((sum(hops.received1), features.shape[1])).index_add(
        0, hops.gateway_rows, features)
    rows1 = exchange_rows(summed, hops.received1, hops.sent1, group)
    weights = exchange_rows(in_order[:, -1:], hops.pairs_received1, hops.pairs_sent1, group)
    out = grads.new_zeros((pairs, grads.shape[1]))
    out[:, :-1] = rows1[hops.row_of_pair] * hops.first.unsqueeze(-1).to(grads.dtype)
    out[hops.order1, -1:] = weights
    return out

"""What pricing a plan's mixture of experts needs, read once from the plan: its widths,
its experts over ep, its FLOPs per token, its routing's imbalance and, for a two-hop
dispatch, how many nodes and ranks a token's experts lie on (planc.estimate.kernel_cost and
planc.estimate.instruction_cost price with it)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import comb, gcd
from types import SimpleNamespace

from planc.models import family_of, moe
from planc.plan.plan import Plan
from planc.vocabulary.model_options import expert_groups_of


@dataclass(frozen=True)
class Mixture:
    """What pricing a plan's mixture of experts needs: its widths, the experts on one
    rank of the ep group, and its forward FLOPs per token (planc.models.moe)."""

    hidden: int
    expert_ffn: int
    experts: int
    top_k: int
    shared: int
    local: int  # experts / ep
    flops_per_token: float
    # The busiest ep rank's rows over the mean (planc.models.moe.routing_imbalance); 1
    # without ep, where every rank holds every expert and receives every row it routes.
    imbalance: float = 1.0
    # node-limited routing (expert_groups, route_groups; None: every expert)
    expert_groups: int = 1
    route_groups: int | None = None
    # optimize { recompute_moe_activation }: the experts' SwiGLU product computed again
    # in the backward (and again in a split backward's weight step)
    product_recomputed: bool = False
    # model { routing = consecutive }: a benchmark's forced gate, not a router's choice
    consecutive: bool = False

    @staticmethod
    def of(plan: Plan) -> "Mixture | None":
        m = plan.model
        if not family_of(plan).has_mixture:
            return None
        one = SimpleNamespace(model=m, batch=1, seq=1, hidden=m.hidden)  # one token
        imbalance = moe.routing_imbalance(m) if plan.mesh.ep > 1 else 1.0
        groups = expert_groups_of(m)
        return Mixture(m.hidden, m.expert_ffn, m.experts, m.top_k, m.shared_experts,
                       m.experts // plan.mesh.ep, moe.forward_flops("moe", one), imbalance,
                       *(groups if groups is not None else (1, None)),
                       product_recomputed=plan.recomputes_moe_activation,
                       consecutive=moe.routes_consecutively(m))

    @property
    def counts_bytes(self) -> int:
        """The all-to-all of counts before a dispatch (planc.models.moe.expert_counts_bytes)."""
        return moe.expert_counts_bytes(self.experts)

    def nodes_per_token(self, nodes: int) -> float:
        """How many of ``nodes`` (the ep group's, each holding experts / nodes of the
        experts) one token's top_k experts lie on, on average at uniform routing; with
        node-limited routing whose groups are those nodes, among its ``route_groups``
        (planc.models.moe)."""
        return self.holders_per_token(nodes, nodes)

    def holders_per_token(self, holders: int, nodes: int) -> float:
        """How many of ``holders`` (the ep group's ranks or its nodes, each holding
        experts / holders of the experts, on ``nodes`` nodes) one token's top_k experts
        lie on, on average at uniform routing: ``N (1 - C(E - E/N, k) / C(E, k))``; with
        node-limited routing whose groups are the nodes, among the holders of its
        ``route_groups`` nodes; under ``routing = consecutive``, its k consecutive
        experts' holders (:func:`consecutive_holders`), whatever the groups."""
        per_holder = self.experts // holders
        if self.consecutive:
            return consecutive_holders(self.experts, self.top_k, per_holder)
        among = self.experts if self.route_groups is None or \
            self.expert_groups != nodes else self.route_groups * (self.experts // nodes)
        spread = among // per_holder
        return spread * (1.0 - comb(among - per_holder, self.top_k) / comb(among, self.top_k))

    def busiest_flops(self, flops: float) -> float:
        """A mixture instruction's ``flops`` (at the mean routing) as the busiest ep rank
        runs them: its routed experts' share scaled by the imbalance."""
        if self.imbalance == 1.0:
            return flops
        # per token: its top_k experts and their weighted sum (planc.models.moe)
        routed = self.top_k * (moe.expert_flops(1, self.hidden, self.expert_ffn)
                               + 2.0 * self.hidden)
        return flops * (1.0 + (self.imbalance - 1.0) * routed / self.flops_per_token)


@cache
def consecutive_holders(experts: int, top_k: int, per_holder: int) -> float:
    """How many holders of ``per_holder`` contiguous experts each (an ep rank's, or a
    node's) one token's experts lie on under ``routing = consecutive``, on average over
    the tokens: token t's are t x top_k ... t x top_k + top_k - 1 modulo experts, so the
    pattern repeats every experts / gcd(experts, top_k) tokens, each expert taking the
    same share of them (balanced by construction)."""
    step = gcd(experts, top_k)  # the first experts of the tokens: the multiples of step
    blocks = (experts - 1) // per_holder + 1
    if top_k >= experts:
        return float(blocks)
    spans = 0
    for first in range(0, experts, step):
        last = first + top_k - 1
        if last < experts:
            spans += last // per_holder - first // per_holder + 1
        else:  # round past the last expert: [first, experts) and [0, last - experts]
            wrapped = (last - experts) // per_holder + 1
            spans += min(blocks, (experts - 1) // per_holder - first // per_holder + 1
                         + wrapped)
    return spans / (experts // step)

"""What one instruction of a rank program costs, from its operands and the build's group
table alone (not graph.json): the one model the compiler optimises with (planc.estimate.cost).

- A compute instruction on a GPU that :mod:`planc.estimate.kernel_cost` knows (the
  topology's preset names it) takes what its kernels achieve there: a matrix multiply by
  its shape, attention at FlashAttention's published rates, anything else its memory
  traffic, each plus a fixed cost per kernel. On any other device it takes the longer of
  its ``flops`` at the device's achievable rate (one efficiency) and its memory traffic
  at the device's memory bandwidth (planc.estimate.roofline), plus the device's fixed
  cost per instruction (a CPU's Python and dispatch for the runtime's step, which
  ``planc calibrate`` measures on the runtime's own instructions, per operator and apart
  for gradient steps: ``Device.instruction_overhead``; 0 elsewhere).
- A collective with a ``route`` takes that route's time on its group (ring, tree or
  hierarchical, as NCCL's tuning model prices its algorithms, ``src/graph/tuning.cc``):
  on each placement on nodes that the groups of its reference have on its stage
  (programs/groups.json), the slowest, which is the time the route pass predicted.
- Any other transfer (pipeline sends and receives, all_to_all) takes the ring time of
  planc.estimate.cost on a group of its reference's size, inside or across nodes as rank 0's
  group of that reference lies.
- Every transfer also pays the device's ``handoff``: on a CPU the runtime runs each
  program stream in a thread of its own, and a transfer the compute stream waits for
  costs a wake-up of the transfer's thread and one of the compute thread (the round
  trip ``planc calibrate`` measures); 0 elsewhere.
- Ring attention (a compute instruction with ``ring_steps`` over the cp group) runs its
  steps as the runtime does: each step's partial attention (1/steps of its compute)
  overlapped with the shift travelling meanwhile, one hop of ``bytes`` (its send and its
  receive run together); in the backward a step's K/V shift and the previous block's
  dK/dV shift share the link (:func:`ring_seconds`).
- A mixture of experts over an ep group adds its dispatch and combine, each an
  all-to-all of ``bytes`` (its (token, expert) rows at uniform routing; with ``fp8``
  what goes to the experts, a forward's rows and a backward's gradients of their
  outputs, one byte an element and a scale a tile) times the
  routing's imbalance (the busiest rank's rows over the mean, model moe's ``imbalance``;
  its experts' GEMMs take as many rows more) over the group,
  priced on where the group's members sit (:meth:`planc.estimate.cost.CostModel.all_to_all_seconds`:
  NVLink to peers on the node, the rank's NIC to the others, at once); the replay charges
  that part of the instruction to the ep axis as exposed communication, not to compute.
- A mixture cut at its all-to-alls (schedule { overlap_all_to_all }) prices each piece
  as its part of the whole (planc.estimate.kernel_cost.KernelModel.mixture_part_seconds)
  and each dispatch and combine as a transfer: the same all-to-all, on the ep stream,
  where the compute stream waits for it only if nothing else is left to run.
- While a cut mixture's all-to-all runs, its kernel holds SMs
  (:meth:`InstructionCosts.held_sms`), and a compute step beside it takes what the
  kernel model prices on the SMs left (:meth:`InstructionCosts.contended`); the replay
  runs it at that rate for as long as they overlap (planc.estimate.block_replay).
- A mixture whose balance loss spans the ranks of a sequence adds, to its forward and
  recomputed forward, the all-reduce of its counts (``counts_bytes``) over
  ``counts_group``, in series (the loss needs the sum before it can be formed); with a
  capacity, the all-gather of every rank's choices and positions (``capacity_bytes``
  each) over the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.estimate.cost import CostModel, Placement
from planc.program.names import Kind
from planc.program.groups import PIPELINE, GroupTable
from planc.program.operands import FORWARD_STEPS, GRADIENT_STEPS, Operands, StepKind
from planc.program.program import Instruction
from planc.estimate.parameter_counts import local_parameter_elements
from planc.plan.plan import DTYPE_BYTES, Plan
from planc.estimate.kernel_cost import ALL_TO_ALL_SMS, MIXTURE, TWO_HOP_SMS, KernelModel
from planc.estimate.mixture import Mixture
from planc.estimate.roofline import (memory_bound_bytes, roofline_seconds, traffic,
                                     transcendentals)
from planc.vocabulary.model_options import fp8_tile, gemm_input_bytes

FP32_BYTES = 4


@dataclass(frozen=True)
class Accumulation:
    """optimize { grad_accumulation } other than fused: after each microbatch's weight
    gradient, a memory-bound kernel per parameter tensor adds it into the step's
    gradient. In the gradient's dtype it reads both and writes the sum (``add_``: 3
    elements' bytes, one kernel; Megatron-LM's ``param.main_grad.add_(param.grad)``, or
    autograd's accumulation into ``param.grad``). Into an fp32 buffer beside 16-bit
    gradients (shard { dp { fp32_grads } }: DeepSpeed's BF16_Optimizer,
    ``update_hp_grads``: ``hp_grad.add_(lp.grad.to(fp32))``) a cast reads the 16-bit
    gradient and writes an fp32 copy, then the add reads two fp32 tensors and writes one:
    2 + 4 + 3 x 4 = 18 bytes a parameter, two kernels. ``autograd`` adds from the second
    microbatch on (the first microbatch's gradient becomes ``param.grad``), so each
    microbatch carries (m - 1) / m of one addition."""

    bytes_per_parameter: float
    kernels: int
    share: float  # additions per microbatch, on average over the step's

    @staticmethod
    def of(plan: Plan) -> "Accumulation | None":
        how = plan.optimize.grad_accumulation
        if how == "fused":
            return None
        gradient = DTYPE_BYTES[plan.model.dtype]
        if plan.shard.dp.fp32_grads and gradient != FP32_BYTES:
            moved, kernels = gradient + FP32_BYTES + 3 * FP32_BYTES, 2
        else:
            moved, kernels = 3 * gradient, 1
        microbatches = plan.schedule.microbatches
        share = (microbatches - 1) / microbatches if how == "autograd" else 1.0
        return Accumulation(moved, kernels, share)


def group_of(operands: Operands) -> str:
    """The group reference of groups.json a transfer runs on (pipeline transfers name
    their peer stage instead: theirs is the pipeline's)."""
    return operands.group or PIPELINE


def axis_of(operands: Operands | None) -> str | None:
    """The mesh axis whose communication a transfer is (a sub-group's is its whole
    group's), to which waiting for it is charged; None for compute."""
    if operands is None or operands.payload is None:
        return None
    return group_of(operands).partition("/")[0]


# A mixture of experts over an ep group: the dispatch and the combine, forward or
# backward, each an all-to-all of its rows at uniform routing (a forward's after one of
# its counts, planc.models.moe.expert_counts_bytes), in series with the
# experts' GEMMs (no overlap within one microbatch: Megatron-Core's 1F1B A2A overlap
# hides them behind another microbatch, which the replay does not model yet).
EXPERT_ALL_TO_ALLS = 2
# ... or cut at them (schedule { overlap_all_to_all }): its all-to-alls transfers of their
# own, its routed experts a piece of their own
CUT_MIXTURE = ("counts", "dispatch", "combine")
CUT_EXPERTS = "moe_experts"


def ring_seconds(compute: float, shift: float, steps: int, backward: bool) -> float:
    """Ring attention's time: per ring step the longer of its partial attention and the
    shifts in flight (Liu et al. 2023: the shift hides behind the block's compute). The
    forward shifts a K/V block at every step but the last; the backward also shifts a
    dK/dV accumulator at every step."""
    total = 0.0
    for step in range(steps):
        hops = (step < steps - 1) + (1 if backward else 0)
        total += max(compute / steps, hops * shift)
    return total


class StageCosts:
    """The seconds of each instruction of one stage's program (a callable, for the
    replay), and of the all-to-alls a mixture of experts runs inside its compute
    instruction (:meth:`exchange`), which the replay reports as the ep axis's."""

    def __init__(self, costs: "InstructionCosts", stage: int):
        self.costs, self.stage = costs, stage
        self.known = costs.seconds

    def __call__(self, instruction: Instruction) -> float:
        value = self.known.get(instruction.node)
        if value is None:
            value = self.known[instruction.node] = self.costs._priced(instruction, self.stage)
        return value

    def exchange(self, instruction: Instruction) -> float:
        self(instruction)  # prices it, and its all-to-alls with it
        return self.costs.exchanges.get(instruction.node, 0.0)

    def held_sms(self, instruction: Instruction) -> int:
        return self.costs.held_sms(instruction)

    def contended(self, instruction: Instruction, held: int) -> float:
        return self.costs.contended(instruction, self.stage, held)


class InstructionCosts:
    """Seconds of each compute and transfer instruction of one build, found once per
    node: ``costs(instruction, stage)``."""

    def __init__(self, plan: Plan, groups: GroupTable, gpu=None):
        self.cost = CostModel(plan.topology)
        self.bandwidth = plan.topology.device.bandwidth
        device = plan.topology.device
        self.handoff = device.handoff
        self.device = device
        self.optimizer = plan.train.optimizer.name
        self.dtype_bytes = DTYPE_BYTES[plan.model.dtype]
        self.rate = device.flops * device.efficiency
        # None: the one-efficiency roofline
        self.kernels = KernelModel(plan, gpu) if gpu is not None else KernelModel.of(plan)
        # model { fp8 } priced at the dtype's rate: only the kernel model of a GPU with an
        # FP8 peak (a named preset's, such as dgx-h100) has FP8's; the roofline of one
        # efficiency (a CPU, a calibrated or a hand-written device) has none
        self.fp8_at_the_dtype_rate = fp8_tile(plan.model) is not None and (
            self.kernels is None or not self.kernels.fp8_speedup)
        self.mixture = Mixture.of(plan)  # None: no mixture of experts
        # model { fp8 }: the dispatch moves each row as E4M3 bytes and a scale a tile
        # (planc.runtime.families.moe._Fp8Dispatch), its share of the dtype's bytes
        self.dispatch_share = gemm_input_bytes(plan.model) / DTYPE_BYTES[plan.model.dtype]
        self.accumulation = Accumulation.of(plan)  # None: fused into the GEMM
        self.parameter_elements = local_parameter_elements(plan) \
            if self.accumulation is not None else {}
        self.groups = groups
        self.seconds: dict[str, float] = {}  # by node
        self.exchanges: dict[str, float] = {}  # a mixture's all-to-alls, by node
        self.transfers: dict[tuple, float] = {}  # by what a transfer's time depends on
        self.sizes: dict[str, int] = {}
        self.crossing: dict[str, bool] = {}
        self.sharing: dict[int, KernelModel] = {}  # by SMs held: the kernels beside them
        self.slowed: dict[tuple[str, int], float] = {}  # by (node, SMs held)

    def __call__(self, instruction: Instruction, stage: int) -> float:
        seconds = self.seconds.get(instruction.node)
        if seconds is None:
            seconds = self.seconds[instruction.node] = self._priced(instruction, stage)
        return seconds

    def of_stage(self, stage: int) -> StageCosts:
        """``self(instruction, stage)`` for the instructions of one stage's program, as
        one call: the replay asks it for every instruction it runs."""
        return StageCosts(self, stage)

    def held_sms(self, instruction: Instruction) -> int:
        """The SMs a transfer holds while it runs, which the compute kernels beside it
        cannot use: a cut mixture's all-to-alls on a GPU the kernel model knows
        (:data:`planc.estimate.kernel_cost.TWO_HOP_SMS` for a two-hop one, else
        ``ALL_TO_ALL_SMS``); 0 for anything else (no other transfer's SMs are modelled)."""
        operands = instruction.operands
        if self.kernels is None or operands is None or operands.kernel is not None or \
                operands.payload not in CUT_MIXTURE:
            return 0
        return TWO_HOP_SMS if operands.hops == 2 else ALL_TO_ALL_SMS

    def contended(self, instruction: Instruction, stage: int, held: int) -> float:
        """Seconds of a compute instruction run while transfers hold ``held`` SMs."""
        key = (instruction.node, held)
        seconds = self.slowed.get(key)
        if seconds is None:
            kernels = self.sharing.get(held)
            if kernels is None and self.kernels is not None:
                kernels = self.sharing[held] = self.kernels.sharing(held)
            seconds = self.slowed[key] = self._priced(instruction, stage, kernels)
        return seconds

    def _priced(self, instruction: Instruction, stage: int,
                kernels: KernelModel | None = None) -> float:
        """``kernels``: the compute's kernel model, if not this build's own (the GPU
        with some SMs held by transfers: :meth:`contended`)."""
        operands = instruction.operands
        if operands is None:
            raise ValueError(f"{instruction.op} {instruction.node} has no operands to cost")
        kernels = kernels or self.kernels
        if operands.kernel is not None:
            moved = traffic(operands.kernel, self.optimizer) * operands.output_bytes
            if kernels is not None:
                seconds = kernels.seconds(operands, moved)
            else:
                flops = operands.flops
                if operands.kernel == MIXTURE and self.mixture is not None and flops:
                    flops = self.mixture.busiest_flops(flops)
                elif operands.kernel == CUT_EXPERTS and self.mixture is not None:
                    flops *= self.mixture.imbalance  # every row routed: the busiest rank's
                moved = memory_bound_bytes(operands, moved, self.dtype_bytes)
                seconds = roofline_seconds(flops, moved, self.rate, self.bandwidth,
                                           transcendentals(operands, self.dtype_bytes),
                                           self.device.exp_rate) + \
                    self.device.instruction_overhead(operands.kernel,
                                                     operands.step in GRADIENT_STEPS)
            if self.accumulation is not None and operands.params and \
                    operands.step in GRADIENT_STEPS and \
                    (operands.step == StepKind.WEIGHT or operands.weight_step is None):
                # a weight gradient: a whole backward's, or a split one's W step
                # a linear cut into pieces over its tokens (tp_overlap) adds once
                pieces = operands.tokens[1] if operands.tokens is not None else 1
                seconds += self.accumulation_seconds(operands.params) / pieces
            if operands.ring_steps:
                shift = self.cost.transfer_seconds(Kind.RECV.value, operands.bytes,
                                                   self._size(operands.group),
                                                   self._crosses(operands.group))
                seconds = ring_seconds(seconds, shift, operands.ring_steps,
                                       operands.step == StepKind.BACKWARD)
            elif operands.group is not None:  # a mixture of experts over its ep group
                # the busiest rank receives (dispatch) and sends back (combine) the
                # most rows, and the all-to-all lasts as long as its share
                imbalance = self.mixture.imbalance if self.mixture is not None else 1.0
                rows = (operands.bytes or 0) * imbalance
                # with model { fp8 }, what goes to the experts is FP8 (a forward's rows, a
                # backward's gradients: planc.runtime.families.moe._Fp8Combine), what
                # comes back the dtype (DeepSeek-V3, section 3.3)
                exchange = self.expert_all_to_all(
                    operands.group, rows * self.dispatch_share, stage) + \
                    (EXPERT_ALL_TO_ALLS - 1) * self.expert_all_to_all(operands.group, rows,
                                                                        stage)
                if operands.step in FORWARD_STEPS and self.mixture is not None:
                    # the counts that size the dispatch, before it (as a cut one's)
                    exchange += self.expert_all_to_all(
                        operands.group, self.mixture.counts_bytes, stage)
                self.exchanges[instruction.node] = exchange
                seconds += exchange
            # a balance loss's counts, in a forward: their backward sends nothing
            if operands.counts_group is not None and operands.step in FORWARD_STEPS:
                size, crosses = self._size(operands.counts_group), \
                    self._crosses(operands.counts_group)
                if operands.counts_bytes:
                    seconds += self.cost.transfer_seconds(
                        Kind.ALL_REDUCE.value, operands.counts_bytes, size, crosses)
                if operands.capacity_bytes:  # the choices' and positions' all-gathers
                    seconds += self.cost.transfer_seconds(
                        Kind.ALL_GATHER.value, operands.capacity_bytes * size, size, crosses)
            return seconds
        kind = instruction.op
        if operands.payload in CUT_MIXTURE:
            return self._cut_all_to_all(operands, stage)
        ref, route = operands.group or PIPELINE, operands.route  # group_of, inlined
        # Transfers of one size on one group cost the same (every layer's, for one).
        key = (kind, route, ref, stage if route is not None else None, operands.bytes)
        seconds = self.transfers.get(key)
        if seconds is not None:
            return seconds
        if route is not None:
            placements = self.groups.placements(ref, stage) or \
                (Placement.within_node(self._size(ref)),)
            seconds = max(self.cost.route_time(route, kind, operands.bytes, placement)
                          for placement in placements)
        else:
            seconds = self.cost.transfer_seconds(kind, operands.bytes, self._size(ref),
                                                 self._crosses(ref))
        seconds += self.handoff
        self.transfers[key] = seconds
        return seconds

    def _cut_all_to_all(self, operands: Operands, stage: int) -> float:
        """A cut mixture's counts, dispatch or combine (planc.passes.split_dispatch),
        priced as the uncut mixture prices its all-to-alls: the busiest rank's rows
        (``bytes`` times the imbalance; the counts are one integer an expert), what goes
        to the experts (a forward's dispatch, a backward's combine: the gradients of
        their outputs) in FP8 with model { fp8 }, on where the ep group's members sit;
        plus the handoff of a transfer on its own stream."""
        imbalance = self.mixture.imbalance if self.mixture is not None and \
            operands.payload != "counts" else 1.0
        toward_experts = (operands.payload, operands.direction) in (
            ("dispatch", "forward"), ("combine", "backward"))
        share = self.dispatch_share if toward_experts else 1.0
        nbytes = (operands.bytes or 0) * imbalance * share
        if operands.hops == 2 and self.mixture is not None:
            placements = self.groups.placements(operands.group, stage) or \
                (Placement.within_node(self._size(operands.group)),)
            # one row a token (its pairs' bytes over top_k): the network carries one per
            # node it reaches, NVLink one per rank
            per_token = nbytes / self.mixture.top_k
            return max(self.cost.two_hop_seconds(
                per_token * self.mixture.holders_per_token(p.size, p.nodes),
                per_token * self.mixture.nodes_per_token(p.nodes), p)
                for p in placements) + self.handoff
        return self.expert_all_to_all(operands.group, nbytes, stage) + self.handoff

    def accumulation_seconds(self, params: tuple[str, ...]) -> float:
        """What adding one microbatch's gradients of ``params`` into the step's costs
        (:class:`Accumulation`): their bytes at the memory bandwidth and a launch per
        kernel, on average per microbatch."""
        accumulation = self.accumulation
        elements = sum(self.parameter_elements[name] for name in params)
        if self.kernels is not None:
            bandwidth, launch = self.kernels.bandwidth, self.kernels.gpu.launch
        else:
            bandwidth, launch = self.bandwidth, self.device.overhead
        return accumulation.share * (elements * accumulation.bytes_per_parameter / bandwidth
                                     + len(params) * accumulation.kernels * launch)

    def expert_all_to_all(self, ref: str, nbytes: float, stage: int) -> float:
        """One all-to-all of a mixture over the ep groups of ``ref`` on ``stage``: the
        slowest of their placements on nodes."""
        placements = self.groups.placements(ref, stage) or \
            (Placement.within_node(self._size(ref)),)
        return max(self.cost.all_to_all_seconds(nbytes, placement)
                   for placement in placements)

    def _size(self, ref: str) -> int:
        if ref not in self.sizes:
            self.sizes[ref] = self.groups.size(ref)
        return self.sizes[ref]

    def _crosses(self, ref: str) -> bool:
        if ref not in self.crossing:
            self.crossing[ref] = self.groups.crosses_nodes(ref)
        return self.crossing[ref]

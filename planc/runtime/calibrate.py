"""Measure the links this machine's backend actually has: alpha and beta per link type.

Run on every rank of a launched world (``planc calibrate`` starts one on this machine;
on a cluster, or the emulated one of bench/topology.py, start it on every node with the
usual RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; planc calibrate's own ranks meet in
a private store instead, planc.runtime.launcher.rendezvous):

    python -m planc.runtime.calibrate --devices-per-node L -o topology.json

For each link type, inside a node and between nodes, it measures (the slowest rank's
median time, every pair or group of the level at once, so that each link carries what a
training step puts on it):

- one message between pairs of ranks: its latency (half the smallest exchange) and its
  bandwidth (the slope of the least-squares line through the sizes), the link's alpha
  and beta, which tree routes use;
- all_reduce, reduce_scatter and all_gather on the level's groups (a node's ranks; the
  ranks with the same place on every node): the bus bandwidth each achieves and its
  latency per call beyond the steps' latencies, as in NCCL's tuning model (planc.estimate.cost);
- the same collectives of 4 KB, and planc's tree, on each of the level's pairs in turn
  while every other rank computes, as in a training step
  (:func:`while_others_compute_each`): the latency a message pays in a step (a pair's
  all_gather, one ring step), which the link's ``latency`` holds, and what each
  collective's call costs beyond its steps.

The compute rate is that of an fp32 matrix multiply with every rank multiplying at once,
the memory bandwidth that of a 64 MB copy. The overlap is the share of an all_reduce that
hides behind that multiply when both run at once (the device's ``overlap``, which
tp_overlap's chooser reads): near 1 where the backend has its own engines, near 0 where
gloo's threads need the cores the multiply fills. The overhead is what a compute
instruction costs beyond its arithmetic: the runtime's forward and backward step of a tiny
operator (planc.runtime.calibrate_device.measure_overhead), which on a CPU is most of a
small model's step.
Rank 0 writes the topology atomically (planc.plan.presets; a plan names it with
``topology { preset = "FILE" }``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from planc.host.files import write_atomically
from planc.host.outputs import path
from planc.runtime.calibrate_fit import medians, slope_fit
from planc.runtime.calibrate_device import (BATCH, measure_compute, measure_exponentials,
                                            measure_memory, measure_overhead,
                                            measure_overlap, timings)
from planc.plan.presets import calibrated_document
from planc.runtime.calibrate_instructions import (measure_handoff, measure_instructions,
                                                  tiny_operator, while_others_compute_each)
from planc.runtime.launcher.rendezvous import joined_store, launched_rank
from planc.runtime.engine.host_memory import keep_freed_memory
from planc.runtime.engine.collectives import all_gather_single, reduce_scatter_single
from planc.estimate.cost import steps, tree_depth

SIZES = (4 << 10, 4 << 20, 16 << 20)  # bytes: latency, then two for the slope
# --quick: a small model's messages (a tiny plan's activations and gradients are tens
# of KB to a MB), in seconds on 2 cores rather than a minute
QUICK_SIZES = (4 << 10, 256 << 10, 1 << 20)
QUICK_REPEATS = 3
REPEATS = 5


def subgroups(world: int, per_node: int) -> dict[str, tuple[object, int, int]]:
    """{"intra": (this rank's node group, its size, its index in it), "inter": (its group
    across nodes, ...)}; every rank creates every group in one order, as torch.distributed
    requires (None: a group of one)."""
    rank, nodes = dist.get_rank(), world // per_node
    mine = {}
    for node in range(nodes):
        members = list(range(node * per_node, (node + 1) * per_node))
        group = dist.new_group(members) if per_node > 1 else None
        if rank in members:
            mine["intra"] = (group, per_node, members.index(rank))
    for local in range(per_node):
        members = [node * per_node + local for node in range(nodes)]
        group = dist.new_group(members) if nodes > 1 else None
        if rank in members:
            mine["inter"] = (group, nodes, members.index(rank))
    return mine


def _peer(level: str, per_node: int, nodes: int) -> int | None:
    """This rank's partner for point-to-point measurements: the next local rank (intra)
    or the same place on the other node of a pair of nodes (inter); None: it sits out."""
    rank = dist.get_rank()
    node, local = divmod(rank, per_node)
    if level == "intra":
        partner = local ^ 1
        return node * per_node + partner if partner < per_node else None
    partner = node ^ 1
    return partner * per_node + local if partner < nodes else None


def measure_point_to_point(level: str, per_node: int, nodes: int, repeats: int,
                           sizes: tuple[int, ...]
                           ) -> tuple[list, tuple[float, float]]:
    """(timings, (bandwidth, latency)) of one message between pairs of ranks, every pair
    of the level at once; the lower rank of a pair sends, the other receives."""
    peer, rank = _peer(level, per_node, nodes), dist.get_rank()
    measured = []
    for nbytes in sizes:
        buffer = torch.ones(max(nbytes // 4, 1))

        def transfer(b=buffer):
            if peer is None:
                return
            if rank < peer:
                dist.send(b, peer)
                dist.recv(b[:1], peer)  # the acknowledgement: a one-way time, not a post
            else:
                dist.recv(b, peer)
                dist.send(b[:1], peer)
        measured.append([nbytes, timings(transfer, nbytes, repeats)])
    points = medians(measured)
    (_, t_small) = sorted(points)[0]
    slope, _ = slope_fit(points)
    # Half of the smallest exchange is one message's latency; the slope, its bytes.
    return measured, (1 / slope, t_small / 2)


def measure_collectives(level: str, groups: dict, repeats: int, latency: float,
                        sizes: tuple[int, ...]
                        ) -> tuple[dict, dict]:
    """({kind: timings}, {kind: {bandwidth, latency}}) of each collective on the level's
    groups, all groups at once: the bus bandwidth from the slope, the latency of a call
    from what the smallest size takes beyond the steps' latencies."""
    group, size, _ = groups[level]
    timed_kinds, tuned = {}, {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        measured = []
        for nbytes in sizes:
            whole = torch.ones(nbytes // 4)
            part = torch.ones(nbytes // 4 // size)
            operation = {
                "all_reduce": lambda: dist.all_reduce(whole, group=group),
                "reduce_scatter": lambda: reduce_scatter_single(part, whole, group=group),
                "all_gather": lambda: all_gather_single(whole, part, group=group),
            }[kind]
            measured.append([nbytes, timings(operation if group is not None else
                                             lambda: None, nbytes, repeats)])
        timed_kinds[kind] = measured
        if group is None:
            continue
        slope, at_zero = slope_fit(medians(measured))
        steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
        factor = 2 * (size - 1) / size if kind == "all_reduce" else (size - 1) / size
        tuned[kind] = {"bandwidth": factor / slope,
                       "latency": max(at_zero - steps * latency, 0.0)}
    if group is not None and size > 1:
        timed_kinds["tree"], tuned["tree"] = measure_tree(groups[level], repeats, sizes)
    return timed_kinds, tuned


def measure_tree(level_group: tuple, repeats: int, sizes: tuple[int, ...]
                 ) -> tuple[list, dict]:
    """(timings, {bandwidth, latency}) of a tree all-reduce (planc's recipe, run as planc
    runs it) on the level's groups: the latency and bandwidth of one hop,
    ``t = 2 depth (latency + fan bytes / bw)``."""
    from planc.program.routes import tree
    from planc.runtime.engine.routes import Route, all_reduce

    group, size, index = level_group
    members = tuple(dist.get_process_group_ranks(group))
    recipe = tree("all_reduce", (size,))
    route = Route(recipe.positions[index], recipe.chunks, index, {}, {}, group, members)
    measured = []
    for nbytes in sizes:
        buffer = torch.ones(nbytes // 4)
        measured.append([nbytes, timings(lambda b=buffer: all_reduce(route, b), nbytes,
                                         repeats)])
    slope, at_zero = slope_fit(medians(measured))
    hops, fan = 2 * tree_depth(size), (1 if size <= 2 else 2)
    return measured, {"bandwidth": hops * fan / slope, "latency": at_zero / hops}


def level_pairs(level: str, per_node: int, nodes: int) -> list[tuple[int, int]]:
    """The level's disjoint pairs of ranks: neighbours on node 0 (intra), or each place
    of node 0 with the same place on node 1 (inter)."""
    if level == "intra":
        return [(local, local + 1) for local in range(0, per_node - 1, 2)]
    return [(local, per_node + local) for local in range(per_node)] if nodes > 1 else []


LOADED_BATCHES = 5  # at least, for the figures measured while the other ranks compute


def calls_under_load(pairs: list[tuple[tuple[int, int], object]], repeats: int,
                     smallest: int) -> dict:
    """{kind: seconds}: each collective of 4 KB on a pair of the level, and planc's tree
    all_reduce, while every other rank computes (:func:`while_others_compute_each`):
    BATCH calls, each after a tiny operator's step of compute, as a step reaches its
    collectives (the partner then arrives when its own compute and the scheduler let it,
    not already waiting: back to back, a pair's tree all_reduce took 0.05-0.4 ms here,
    after compute 1.1-1.6 ms, and the demo's runs wait about 4 ms for each of theirs).
    ``pairs``: (the pair's ranks, its group), each of the level's pairs in turn; the
    figure is the median of every pair's batches (``repeats`` of them, LOADED_BATCHES at
    least), the slowest member's each. The first pair alone gave figures that moved by
    half from one calibration to the next on 8 ranks of 2 cores (a tree all_reduce 2.5 to
    4.8 ms, a message 2.1 to 3.5 ms: the demo's prediction 151 to 275 ms for a 200 to
    230 ms step); every pair's batches pooled average over which ranks the scheduler
    puts together (ten rounds of the demo: a median error of 11.5 % against 17.0 %, the
    worst +67 % against +145 %; docs/simulate.md). A pair's collective is what
    tiny plans' groups (tp, dp, cp of 2) run; a pair's all_gather is one ring step, a
    message each way at once: the latency of a message in a step."""
    from planc.program.routes import tree
    from planc.runtime.engine.routes import Route, all_reduce

    rank, count = dist.get_rank(), max(repeats, LOADED_BATCHES)
    part = torch.ones(smallest // 4 // 2)
    whole = torch.ones(smallest // 4)
    recipe = tree("all_reduce", (2,))
    forward, backward = tiny_operator()

    def batches(operation) -> list[float]:
        """Seconds per call of ``operation``, each batch's mean after a warm-up batch."""
        times = []
        for _ in range(count + 1):
            spent = 0.0
            for _ in range(BATCH):
                backward(*forward())
                start = time.perf_counter()
                operation()
                spent += time.perf_counter() - start
            times.append(spent / BATCH)
        return times[1:]

    batches_of: dict[str, list[float]] = {}
    for members, group in pairs:
        index = members.index(rank) if rank in members else 0
        route = Route(recipe.positions[index], recipe.chunks, index, {}, {}, group, members)
        operations = {
            "all_reduce": lambda: dist.all_reduce(whole, group=group),
            "reduce_scatter": lambda: reduce_scatter_single(part, whole, group=group),
            "all_gather": lambda: all_gather_single(whole, part, group=group),
            "tree": lambda: all_reduce(route, whole),
        }
        for kind, operation in operations.items():
            batches_of.setdefault(kind, []).extend(while_others_compute_each(
                members, functools.partial(batches, operation), count))
    return {kind: statistics.median(times) for kind, times in batches_of.items()}


def calibrate(per_node: int, repeats: int, sizes: tuple[int, ...] = SIZES) -> dict:
    """Measure, on every rank at once; the topology document (the same on every rank)."""
    world = dist.get_world_size()
    nodes = world // per_node
    groups = subgroups(world, per_node)
    # every rank creates every group, in one order
    pairs = {level: [(pair, dist.new_group(list(pair)))
                     for pair in level_pairs(level, per_node, nodes)]
             for level, members in (("intra", per_node), ("inter", nodes)) if members > 1}
    links, measured = {}, {"backend": dist.get_backend(), "world": world, "nodes": nodes,
                           "repeats": repeats, "sizes": list(sizes), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for level, members in (("intra", per_node), ("inter", nodes)):
        if members < 2:
            continue
        p2p_timings, (bandwidth, latency) = measure_point_to_point(level, per_node, nodes,
                                                                   repeats, sizes)
        timed_kinds, tuned = measure_collectives(level, groups, repeats, latency, sizes)
        timed_kinds = {"point_to_point": p2p_timings, **timed_kinds}
        # A collective's fixed cost per call comes from the figures measured with every
        # rank at it; a message's latency, a ring's step, from the one measured while the
        # other ranks compute, as in a step.
        calls = calls_under_load(pairs[level], repeats, sizes[0])
        loaded = calls["all_gather"]  # one ring step on a pair
        for kind in ("all_reduce", "reduce_scatter"):  # beyond their steps on a pair
            tuned[kind]["latency"] = max(calls[kind] - steps(kind, 2) * loaded, 0.0)
        tuned["tree"]["latency"] = calls["tree"] / (2 * tree_depth(2))  # per hop
        tuned["all_gather"]["latency"] = 0.0
        links[level] = {"bandwidth": bandwidth, "latency": loaded, "collectives": tuned}
        # the medians each figure is fitted to, and every timing behind them (the
        # intervals planc calibrate prints: planc.runtime.calibrate_fit)
        measured[level] = {**{kind: [list(p) for p in medians(timed)]
                              for kind, timed in timed_kinds.items()},
                           "timings": timed_kinds,
                           "latency_every_pair": latency, "calls_under_load": calls,
                           "pairs_under_load": [list(pair) for pair, _ in pairs[level]]}
    if not links:
        raise SystemExit("planc calibrate: a world of one rank has no link to measure; "
                         "start at least 2 ranks")
    # A link this world cannot measure (one device per node, or one node) takes the
    # other's figures; ``measured`` shows which were measured.
    intra = links.get("intra") or links["inter"]
    inter = links.get("inter") or links["intra"]
    flops = measure_compute(repeats)
    memory = measure_memory(repeats)
    exp_rate = measure_exponentials(repeats)
    measured["overlap"] = measure_overlap(repeats)
    measured["overhead"] = measure_overhead()
    measured["handoff"] = measure_handoff()
    measured["overheads"] = measure_instructions(per_node, repeats, flops, memory, exp_rate)
    return calibrated_document(f"calibrated {dist.get_backend()}, {world} ranks on {nodes} "
                               f"node{'s' * (nodes > 1)}", per_node, flops, intra, inter,
                               measured, memory, measured["overlap"]["overlap"],
                               measured["overhead"]["forward"],
                               measured["overhead"]["backward"], measured["handoff"],
                               measured["overheads"], exp_rate)


def output_refusal(path: str, force: bool):
    """Why ``-o PATH`` may not be written (planc.host.outputs.Refusal), or None."""
    from planc.host.output_kinds import BY_KEY
    from planc.host.outputs import Output, first_problem

    return first_problem([Output("-o", path, BY_KEY["topology"])], force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planc.runtime.calibrate")
    parser.add_argument("--devices-per-node", type=int, required=True)
    parser.add_argument("-o", "--output", required=True, type=path)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--force", action="store_true",
                        help="replace a topology file that planc wrote earlier")
    args = parser.parse_args(argv)
    # The allocator settings of the ranks whose instructions this times (planc run's and
    # torchrun's, planc.runtime.engine.host_memory), before gloo starts its threads
    keep_freed_memory()
    launched = launched_rank()
    if isinstance(launched, str):
        print(f"planc calibrate: {launched}", file=sys.stderr)
        return 2
    rank, world = launched
    if args.devices_per_node < 1 or world % args.devices_per_node:
        print(f"planc calibrate: {world} ranks do not fill nodes of {args.devices_per_node}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    timeout = timedelta(seconds=600)
    dist.init_process_group(args.backend, timeout=timeout, rank=rank,
                            world_size=world, store=joined_store(world, timeout))
    try:
        # -o as rank 0 sees it, the rank that writes it, decided for every rank before
        # any measurement (planc.host.outputs' rule: no file planc did not write as a
        # topology is replaced)
        refusal = output_refusal(args.output, args.force) if rank == 0 else None
        refused = torch.tensor([0 if refusal is None else refusal.status])
        dist.broadcast(refused, 0)
        if refused.item():
            if refusal is not None:
                print(f"planc calibrate: {refusal.message}", file=sys.stderr)
            return int(refused.item())
        document = calibrate(args.devices_per_node, args.repeats,
                             QUICK_SIZES if args.quick else SIZES)
        if dist.get_rank() == 0:
            try:
                write_atomically(args.output,
                                 (json.dumps(document, indent=1) + "\n").encode())
            except OSError as exc:  # under torchrun: nobody else says it in one line
                print(f"planc calibrate: cannot write {args.output}: {exc.strerror or exc}",
                      file=sys.stderr)
                return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

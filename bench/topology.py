"""Benchmark: ring, tree and hierarchical all-reduce on an emulated two-node cluster.

Two network namespaces stand for two nodes, joined by a veth pair whose both ends are
rate-limited with ``tc`` (tbf): the inter-node link. The ranks of a node share its
namespace and talk to each other over its loopback; gloo binds to the node's veth
address, so traffic between nodes crosses the limited link and nothing else does.

For each link rate and world size (4 or 8 ranks, half on each node) it:

1. calibrates the links with planc.runtime.calibrate (the same code as ``planc
   calibrate``), giving the cost model's alpha and beta for each link type;
2. measures an all-reduce of every size from 4 KB to 64 MB by each route, as planc's
   runtime runs them (the backend's ring; planc.runtime.engine.routes executing the recipes
   of planc.program.routes for tree and hierarchical): the slowest rank's median time;
3. predicts each route's time with planc.estimate.cost on the calibrated topology, and records
   the route ``auto`` would take.

It reports how often ``auto`` picks the measured-fastest route (or one within 10 % of
it) and the prediction error at the large sizes, and draws measured and predicted time
against size per route (matplotlib, if installed).

    sudo .venv/bin/python bench/topology.py [--ranks 4,8] [--rates 1gbit,200mbit]
        [--repeats 3] [--json OUT] [--plot topology.png]

It needs root (namespaces, veth, tc) and skips with a message otherwise. This kernel
has no netem, so the links differ in rate only; latency is what gloo and the veth pair
have.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from net import free_port  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
LARGE = 16 << 20  # "large sizes" for the prediction error
ROUTES = ("ring", "tree", "hierarchical")
NAMESPACES = ("planc-node0", "planc-node1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
DEVICES = ("planc-v0", "planc-v1")


# --- the emulated cluster -----------------------------------------------------------

def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, *args]
    subprocess.run(command, check=True, capture_output=True)


def teardown() -> None:
    for namespace in NAMESPACES:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def setup(rate: str) -> None:
    teardown()
    for namespace in NAMESPACES:
        _ip("netns", "add", namespace)
    _ip("link", "add", DEVICES[0], "type", "veth", "peer", "name", DEVICES[1])
    for namespace, device, address in zip(NAMESPACES, DEVICES, ADDRESSES):
        _ip("link", "set", device, "netns", namespace)
        _ip("ip", "addr", "add", f"{address}/24", "dev", device, namespace=namespace)
        _ip("ip", "link", "set", device, "up", namespace=namespace)
        _ip("ip", "link", "set", "lo", "up", namespace=namespace)
        _ip("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst",
            "512kb", "latency", "500ms", namespace=namespace)


def why_not_here() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    if os.geteuid() != 0:
        return "it needs root, to create network namespaces, veth pairs and tc qdiscs"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "it needs the ip and tc commands (iproute2)"
    try:
        setup("1gbit")
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"cannot build the emulated nodes ({detail.decode().strip() or exc})"
    finally:
        teardown()
    return None


# --- one rank ---------------------------------------------------------------------------

def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from planc.program.routes import hierarchical, tree
    from planc.runtime.engine import routes as runtime_routes
    from planc.runtime.calibrate import calibrate
    from planc.runtime.calibrate_device import timed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = world // 2
    node, local = divmod(rank, per_node)
    document = calibrate(per_node, args.repeats)
    intra = inter = None
    for k in range(2):
        group = dist.new_group(list(range(k * per_node, (k + 1) * per_node)))
        intra = group if k == node else intra
    for place in range(per_node):
        group = dist.new_group([place, per_node + place])
        inter = group if place == local else inter
    whole = dist.new_group(list(range(world)))
    members = tuple(range(world))
    recipes = {"tree": tree("all_reduce", (per_node, per_node)),
               "hierarchical": hierarchical("all_reduce", (per_node, per_node))}
    plans = {name: runtime_routes.Route(r.positions[rank], r.chunks, rank,
                                        {"intra": intra, "inter": inter},
                                        {"intra": local, "inter": node}, whole, members)
             for name, r in recipes.items()}
    results = []
    for nbytes in SIZES:
        buffer = torch.ones(nbytes // 4)
        operations = {
            "ring": lambda: dist.all_reduce(buffer, group=whole),
            "tree": lambda: runtime_routes.all_reduce(plans["tree"], buffer),
            "hierarchical": lambda: runtime_routes.all_reduce(plans["hierarchical"], buffer),
        }
        for route in ROUTES:
            buffer.fill_(1.0)
            operations[route]()
            if buffer[0].item() != world:  # each route must compute the sum
                raise SystemExit(f"rank {rank}: {route} all-reduce computed "
                                 f"{buffer[0].item()}, not {world}")
            # Timed as the calibration times (small sizes in batches of back-to-back
            # calls), the slowest rank's median.
            buffer.fill_(0.0)
            results.append({"bytes": nbytes, "route": route,
                            "seconds": timed(operations[route], nbytes, args.repeats)})
    if rank == 0:
        Path(args.worker_output).write_text(json.dumps({"topology": document,
                                                        "measured": results}))
    dist.destroy_process_group()


def run_world(ranks: int, rate: str, repeats: int) -> dict:
    """Start ``ranks`` workers, half in each namespace; what rank 0 reported."""
    per_node = ranks // 2
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        port = free_port()
        processes = []
        for rank in range(ranks):
            node = rank // per_node
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                   "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": str(port),
                   "GLOO_SOCKET_IFNAME": DEVICES[node], "OMP_NUM_THREADS": "1"}
            processes.append(subprocess.Popen(
                ["ip", "netns", "exec", NAMESPACES[node], sys.executable, __file__,
                 "--worker", "--worker-output", str(output), "--repeats", str(repeats)],
                env=env))
        codes = [p.wait() for p in processes]
        if any(codes):
            raise SystemExit(f"a rank failed ({codes}) at {ranks} ranks, {rate}")
        return json.loads(output.read_text())


# --- predictions and the report ---------------------------------------------------------

def predict(document: dict, ranks: int) -> dict[int, dict]:
    from planc.estimate.cost import CostModel, Placement
    from planc.plan.presets import calibrated_preset

    per_node = ranks // 2
    cost = CostModel(calibrated_preset(document, "calibrated").topology(2))
    placement = Placement(ranks, 2, per_node, per_node, per_node)
    out = {}
    for nbytes in SIZES:
        candidates = {c.route.value: c.seconds
                      for c in cost.candidates("all_reduce", nbytes, placement)}
        usable = {r: s for r, s in candidates.items() if s is not None}
        out[nbytes] = {"predicted": candidates, "auto": min(usable, key=usable.get)}
    return out


def analyse(configs: list[dict]) -> dict:
    points, right, errors = [], 0, []
    for config in configs:
        measured: dict[int, dict[str, float]] = {}
        for item in config["measured"]:
            measured.setdefault(item["bytes"], {})[item["route"]] = item["seconds"]
        predicted = predict(config["topology"], config["ranks"])
        for nbytes in SIZES:
            times = measured[nbytes]
            fastest = min(times, key=times.get)
            auto = predicted[nbytes]["auto"]
            ok = times[auto] <= 1.10 * times[fastest]
            right += ok
            point = {"ranks": config["ranks"], "rate": config["rate"], "bytes": nbytes,
                     "measured": times, "predicted": predicted[nbytes]["predicted"],
                     "auto": auto, "fastest": fastest, "auto_ok": ok}
            points.append(point)
            if nbytes >= LARGE:
                for route in ROUTES:
                    errors.append(abs(point["predicted"][route] - times[route]) / times[route])
    return {"points": points, "auto_right": right, "points_total": len(points),
            "large_errors": errors}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def report(result: dict) -> str:
    lines = ["| ranks | inter-node link | size | ring ms | tree ms | hierarchical ms "
             "| predicted ring / tree / hier ms | auto | fastest | auto ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        m, q = p["measured"], p["predicted"]
        lines.append(
            f"| {p['ranks']} | {p['rate']} | {_size(p['bytes'])} | {m['ring'] * 1e3:.1f} | "
            f"{m['tree'] * 1e3:.1f} | {m['hierarchical'] * 1e3:.1f} | "
            f"{q['ring'] * 1e3:.1f} / {q['tree'] * 1e3:.1f} / {q['hierarchical'] * 1e3:.1f} | "
            f"{p['auto']} | {p['fastest']} | {'yes' if p['auto_ok'] else 'no'} |")
    errors = result["large_errors"]
    share = result["auto_right"] / result["points_total"]
    lines.append("")
    lines.append(f"auto picked the fastest route (or one within 10 %) at "
                 f"{result['auto_right']} of {result['points_total']} points ({share:.0%}; "
                 f"goal 90 %)")
    if errors:
        lines.append(f"prediction error at {_size(LARGE)} and above: median "
                     f"{statistics.median(errors):.0%}, largest {max(errors):.0%} "
                     f"(goal 25 %)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    configs = sorted({(p["ranks"], p["rate"]) for p in result["points"]})
    figure, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.8),
                                squeeze=False)
    colours = {"ring": "tab:blue", "tree": "tab:green", "hierarchical": "tab:red"}
    for axis, (ranks, rate) in zip(axes[0], configs):
        points = [p for p in result["points"] if (p["ranks"], p["rate"]) == (ranks, rate)]
        sizes = [p["bytes"] for p in points]
        for route in ROUTES:
            axis.plot(sizes, [p["measured"][route] * 1e3 for p in points], "o-",
                      color=colours[route], label=f"{route} measured")
            axis.plot(sizes, [p["predicted"][route] * 1e3 for p in points], "--",
                      color=colours[route], label=f"{route} predicted")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{ranks} ranks on 2 nodes, {rate}")
        axis.set_xlabel("all-reduce size (bytes)")
        axis.set_ylabel("time (ms)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--rates", default="1gbit,200mbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    reason = why_not_here()
    if reason:
        print(f"bench/topology.py: skipped: {reason}")
        return 0
    configs = []
    try:
        for rate in args.rates.split(","):
            for ranks in map(int, args.ranks.split(",")):
                setup(rate)
                started = time.time()
                data = run_world(ranks, rate, args.repeats)
                print(f"  {ranks} ranks, {rate}: {time.time() - started:.0f} s",
                      file=sys.stderr)
                configs.append({"ranks": ranks, "rate": rate, **data})
    finally:
        teardown()
    result = analyse(configs)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps({"configs": configs, **result}, indent=1))
    if args.plot and not plot(result, args.plot):
        print("no plot: matplotlib is not installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

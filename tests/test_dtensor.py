"""planc's derived transfers against PyTorch DTensor's, for the same placements.

For an MLP block (LayerNorm, fc1, GELU, fc2, residual) under every pair of fc1/fc2
placements, with and without sequence parallelism, a 2-rank gloo world runs the block
in DTensor: weights placed as the plan says, activations redistributed to the layouts
planc chose, everything else (the backward pass, the gradients of every parameter)
left to DTensor's autograd. torch.distributed.tensor.debug.CommDebugMode counts the
collectives it issues; planc's graph must contain exactly those, forward and backward.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planc.graph.derive import derive  # noqa: E402
from planc.graph.tensor_parallel import plan_tensor_parallel  # noqa: E402
from planc.lang import load_text  # noqa: E402

pytestmark = pytest.mark.slow

T, H, FFN = 16, 8, 32  # tokens of one microbatch, hidden, ffn
MLP = ("ln2", "fc1", "gelu", "fc2", "mlp_residual")
COMBOS = [(fc1, fc2, sp) for fc1, fc2 in itertools.product(("column", "row", "replicate"),
                                                           repeat=2) for sp in (False, True)]


def planc_plan(fc1: str, fc2: str, sp: bool):
    text = f"""plan mlp {{
      model gpt {{ layers = 1; hidden = {H}; heads = 2; ffn = {FFN}; vocab = 16; seq = {T}
                  batch = 1 }}
      mesh {{ tp = 2 }}
      shard {{ tp {{ fc1 = {fc1}; fc2 = {fc2}; sequence_parallel = {'on' if sp else 'off'} }} }}
    }}"""
    loaded = load_text(text)
    assert loaded.plan is not None, [d.message for d in loaded.diagnostics]
    return loaded.plan


def planc_counts(fc1: str, fc2: str, sp: bool) -> dict[str, int]:
    """Collectives planc derives for the MLP chain of layer 0: activations (forward and
    backward) and the gradient fix-ups of the chain's parameters."""
    graph = derive(planc_plan(fc1, fc2, sp))
    counts: Counter = Counter()
    for _, d in graph.nodes(data=True):
        if d["type"] != "transfer" or d["axis"] != "tp" or d["layer"] != 0:
            continue
        if d["per_microbatch"] and d.get("producer") in MLP and d.get("consumer") in MLP:
            counts[f"{d['phase']} {d['kind']}"] += d["repeat"]
        elif not d["per_microbatch"] and _parameter(graph, d).split(".")[2] in ("ln2", "fc1",
                                                                                "fc2"):
            counts[f"backward {d['kind']}"] += d["repeat"]
    return dict(counts)


def _parameter(graph, data: dict) -> str:
    """The parameter a gradient fix-up works on (the derivation's buckets hold one)."""
    return data.get("tensor") or graph.graph["buckets"][data["bucket"]]["members"][0]["param"]


def _run_block(rank: int, world: int, init: str, layouts: dict, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    # Forked from pytest, which may have run torch operators on its intra-op threads: a
    # forked child has the pool but not its threads, and would wait for them forever.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for key, plan in layouts.items():
        def placement(text: str, weight_dims: tuple[str, ...] = ("seq", "features")):
            if text == "R":
                return [Replicate()]
            if text == "P":
                return [Partial()]
            dim = text[2:-1]
            return [Shard(0 if dim in (weight_dims[0],) else 1)]

        def activation(text: str):
            return placement(text, ("seq",))

        def param(shape, layout_text, dims):
            torch.manual_seed(len(results))
            if layout_text == "R":
                place = [Replicate()]
            else:
                place = [Shard(dims.index(layout_text[2:-1]))]
            return distribute_tensor(torch.randn(*shape) * 0.2, mesh, place).requires_grad_()

        ops = plan["ops"]
        stream = activation(plan["stream"])
        torch.manual_seed(7)
        x = distribute_tensor(torch.randn(T, H), mesh, stream).requires_grad_()
        params = {name: param(shape, storage, dims) for name, (shape, storage, dims)
                  in plan["params"].items()}
        with CommDebugMode() as comm:
            y = F.layer_norm(x.redistribute(mesh, activation(ops["ln2"]["input"])), (H,),
                             params["ln2.weight"], params["ln2.bias"])
            a = y.redistribute(mesh, activation(ops["fc1"]["input"])) @ params["fc1.weight"]
            if "fc1.bias" in ops["fc1"]["params"]:
                a = a + params["fc1.bias"]
            g = a.redistribute(mesh, activation(ops["gelu"]["input"]))
            if "fc1.bias" in ops["gelu"]["params"]:
                g = g + params["fc1.bias"]
            g = F.gelu(g, approximate="tanh")
            f = g.redistribute(mesh, activation(ops["fc2"]["input"])) @ params["fc2.weight"]
            if "fc2.bias" in ops["fc2"]["params"]:
                f = f + params["fc2.bias"]
            r = f.redistribute(mesh, activation(ops["mlp_residual"]["input"]))
            if "fc2.bias" in ops["mlp_residual"]["params"]:
                r = r + params["fc2.bias"]
            block = x + r
            block.to_local().sum().backward()
        with CommDebugMode() as fixups:
            for p in params.values():  # what an optimizer needs: gradients laid out as p
                p.grad.redistribute(mesh, p.placements).to_local()
        counts: Counter = Counter()
        for phase, ops_counts in comm.comm_module_counts["Global"].items():
            if phase in ("forward", "backward"):
                for op, n in ops_counts.items():
                    counts[f"{phase} {_kind(op)}"] += n
        for op, n in fixups.get_comm_counts().items():
            counts[f"backward {_kind(op)}"] += n
        results[key] = dict(counts)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _kind(op) -> str:
    name = str(op).split(".")[-1]
    return {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_reduce": "all_reduce"}.get(name, name)


def _layouts(fc1: str, fc2: str, sp: bool) -> dict:
    tpp = plan_tensor_parallel(planc_plan(fc1, fc2, sp))
    ops = {op: {"input": str(tpp.ops[op].input),
                "params": [u.name for u in tpp.ops[op].params]} for op in MLP}
    params = {}
    for op in MLP:
        for use in tpp.ops[op].params:
            shape = {"ln2.weight": (H,), "ln2.bias": (H,), "fc1.weight": (H, FFN),
                     "fc1.bias": (FFN,), "fc2.weight": (FFN, H), "fc2.bias": (H,)}[use.name]
            dims = {"fc1.weight": ("hidden", "ffn"), "fc2.weight": ("ffn", "hidden"),
                    "fc1.bias": ("ffn",), "fc2.bias": ("hidden",)}.get(use.name, ("hidden",))
            params[use.name] = (shape, str(use.storage), dims)
    return {"stream": str(tpp.stream), "ops": ops, "params": params}


@pytest.fixture(scope="module")
def dtensor_counts():
    import torch.multiprocessing as mp

    layouts = {f"{fc1}/{fc2}/{sp}": _layouts(fc1, fc2, sp) for fc1, fc2, sp in COMBOS}
    with tempfile.TemporaryDirectory() as directory:
        out = str(Path(directory) / "counts.json")
        init = "file://" + str(Path(directory) / "init")
        mp.start_processes(_run_block, args=(2, init, layouts, out), nprocs=2,
                           start_method="fork")
        return json.loads(Path(out).read_text())


def _as_on_gloo(counts: dict[str, int]) -> dict[str, int]:
    """DTensor on gloo redistributes S(d) -> S(e) by an all-gather and a local chunk
    ("CPU process group does not support alltoall yet"), where planc says all_to_all."""
    out: Counter = Counter()
    for key, n in counts.items():
        out[key.replace("all_to_all", "all_gather")] += n
    return dict(out)


@pytest.mark.parametrize("fc1, fc2, sp", COMBOS,
                         ids=[f"{a}-{b}{'-sp' if c else ''}" for a, b, c in COMBOS])
def test_planc_derives_exactly_the_collectives_dtensor_performs(dtensor_counts, fc1, fc2, sp):
    assert _as_on_gloo(planc_counts(fc1, fc2, sp)) == dtensor_counts[f"{fc1}/{fc2}/{sp}"]


def test_megatron_mlp_is_one_all_reduce_each_way(dtensor_counts):
    assert dtensor_counts["column/row/False"] == {"forward all_reduce": 1,
                                                  "backward all_reduce": 1}

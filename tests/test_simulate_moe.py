"""planc simulate on mixtures of experts: the all-to-all's price on where its ranks sit,
the ep axis's share of the step, and the table of docs/simulate.md that compares the
simulator with published MoE training throughput (plans/moe-published/), which
``bench/validation.py --only moe --write`` regenerates.

Published figures, each with its source and what it states:

- Megatron-Core's MoE README at MCore v0.8 (github.com/NVIDIA/Megatron-LM at 0b4c4cf,
  megatron/core/transformer/moe/README.md): Mixtral 8x7B in bf16 at 438 TFLOP/s per GPU,
  on the README's "Reference Best Parallel Mapping" (64 H100s, tp 1, ep 8, pp 4, VP 8,
  micro-batch 1, global batch 256, sequence 4,096). MCore v0.9's README says 468 with the
  same mapping table. Megatron-LM then counted a step's FLOPs with attention's scores
  whole, not halved for the causal mask, which is planc's count.
- Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo,
  best_practice/Qwen3/readme.md): Qwen3-235B-A22B on 256 H100s in bf16, step times and
  TFLOP/s per GPU for five layouts; four are here, and its long-context table's
  forced-balance and dropless TFLOP/s give the routing imbalance its plans state
  (bench/moe_imbalance.py). Their TFLOP/s count causal attention
  as half (200 TFLOP/s x 256 GPUs x 24.2 s is 148 GFLOP per token, which is Qwen3's count
  with half the scores), so the comparison is on tokens per second.
- NeMo AutoModel's performance summary (github.com/NVIDIA-NeMo/Automodel at 01926a5,
  docs/performance-summary.md, DGX-H100, bf16, updated 2025-10-02): step times and
  tokens per second per GPU with a "fake balanced gate ... to simulate ideal expert
  routing", which sends token t to the experts t x top_k on (`routing = consecutive`);
  Qwen3-30B-A3B on 8 GPUs and DeepSeek-V3 on 256 and 1,024 (FSDP with ep). GPT-OSS is
  left out: the moe family cannot write it. Kimi K2 is not here yet: the deepseek family
  could write it, but its step runs the pipeline schedule twice ("GA 2"), which a planc
  step cannot, and the 1,024-GPU DeepSeek-V3 row (GA 4, run as one schedule of 32
  microbatches) already carries that difference. Every one of them ran DeepEP, as the
  ModelZoo's DeepEP rows and
  DeepSeek-V3's own run (FP8, DualPipe) did: their plans write it as
  `optimize { moe_dispatcher = two_hop }`.
- DeepSeek-V3's report (arXiv 2412.19437, abstract and section 1): 180K H800 GPU hours
  per trillion tokens, on 2,048 H800s.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from planc.compile import compile_plan
from planc.estimate.cost import CostModel, Placement
from planc.estimate.kernel_cost import KernelModel, wave_efficiency
from planc.lang import load_file, load_text
from planc.plan.mesh import counts_of
from planc.plan.plan import Plan
from planc.simulate import simulate
from tests.conftest import PLANS, ROOT

MOE_PLANS = PLANS / "moe-published"
DOC = ROOT / "docs" / "simulate.md"
BEGIN = "<!-- moe table: bench/validation.py --only moe --write regenerates it -->"
END = "<!-- end of the moe table -->"
REGENERATE = ".venv/bin/python bench/validation.py --only moe --write"


def megatron_flops_per_token(m, causal: bool) -> float:
    """Megatron-LM's model FLOPs per token of a mixture (megatron/training/training.py,
    num_floating_point_operations): 3 x (forward GEMMs of attention with its k/v groups,
    the scores, top_k gated experts, the logits); ``causal`` halves the scores, as its
    2025 versions do. No router."""
    h, s = m.hidden, m.seq
    scores = 4 * s * h / (2 if causal else 1)
    attention = 4 * h * h * (1 + m.key_value_heads / m.heads) + scores
    experts = (m.top_k + m.shared_experts) * 6 * h * m.expert_ffn
    return 3 * (m.layers * (attention + experts) + 2 * h * m.vocab)


@dataclass(frozen=True)
class Published:
    plan: str  # under plans/moe-published
    run: str  # the run, as the table names it
    source: str  # Markdown link
    figure: str  # what the source states
    step_seconds: float | None = None  # a step, where the source gives it
    tflops: float | None = None  # TFLOP/s per GPU, in the source's count
    gpu_hours_per_trillion: float | None = None

    def tokens_per_gpu(self, plan: Plan) -> float:
        """Tokens per second per GPU that the published figure means."""
        m = plan.model
        if self.step_seconds is not None:
            return m.batch * m.seq / self.step_seconds / plan.world
        if self.gpu_hours_per_trillion is not None:
            return 1e12 / (self.gpu_hours_per_trillion * 3600)
        return self.tflops * 1e12 / megatron_flops_per_token(m, causal=False)


MCORE = ("[MCore v0.8 MoE README](https://github.com/NVIDIA/Megatron-LM/blob/"
         "0b4c4cfced47cffad4cec8c4047986bfa60e7f10/"
         "megatron/core/transformer/moe/README.md)")
MODELZOO = ("[Megatron-MoE-ModelZoo](https://github.com/yanring/Megatron-MoE-ModelZoo/blob/"
            "c1ad0b5c89f425d60febddc38e7f741a16f08bd1/"
            "best_practice/Qwen3/readme.md)")
AUTOMODEL = ("[NeMo AutoModel](https://github.com/NVIDIA-NeMo/Automodel/blob/"
             "01926a5c443b7979463c73341bf64adf79de638e/docs/performance-summary.md)")
DEEPSEEK = "[DeepSeek-V3 report](https://arxiv.org/abs/2412.19437)"
MOE_PUBLISHED = (
    Published("mcore-mixtral-8x7b", "Mixtral 8x7B, all-to-all", MCORE,
              "438 TFLOP/s per GPU", tflops=438),
    Published("automodel-qwen3-30b-a3b", "Qwen3-30B-A3B, balanced, FSDP", AUTOMODEL,
              "21.773 s, 277 TFLOP/s per GPU", step_seconds=21.773, tflops=277),
    Published("modelzoo-qwen3-235b-a2a", "Qwen3-235B-A22B, all-to-all", MODELZOO,
              "24.2 s, 200 TFLOP/s per GPU", step_seconds=24.2, tflops=200),
    Published("modelzoo-qwen3-235b-ep32", "Qwen3-235B-A22B, DeepEP, ep over 4 nodes",
              MODELZOO, "19.7 s, 245 TFLOP/s per GPU", step_seconds=19.7, tflops=245),
    Published("modelzoo-qwen3-235b-ep32-overlap",
              "Qwen3-235B-A22B, DeepEP, ep over 4 nodes, 1F1B all-to-all overlap", MODELZOO,
              "17.6 s, 276 TFLOP/s per GPU", step_seconds=17.6, tflops=276),
    Published("modelzoo-qwen3-235b-tp4", "Qwen3-235B-A22B, DeepEP, tp 4", MODELZOO,
              "29.0 s, 167 TFLOP/s per GPU", step_seconds=29.0, tflops=167),
    Published("automodel-deepseek-v3-256", "DeepSeek-V3, balanced, FSDP", AUTOMODEL,
              "8.18 s, 250 TFLOP/s per GPU", step_seconds=8.18, tflops=250),
    Published("automodel-deepseek-v3-1024", "DeepSeek-V3, balanced, FSDP", AUTOMODEL,
              "37.87 s, 216 TFLOP/s per GPU", step_seconds=37.87, tflops=216),
    Published("deepseek-v3-h800", "DeepSeek-V3 (FP8, H800)", DEEPSEEK,
              "180K GPU hours per 1T tokens", gpu_hours_per_trillion=180e3),
)


def layout(plan: Plan) -> str:
    """tp, ep, pp (x chunks per rank), dp; microbatches x sequences each, the schedule."""
    mesh, microbatches = plan.mesh, plan.schedule.microbatches
    chunks = f" x {plan.shard.pp.virtual}" if plan.shard.pp.virtual > 1 else ""
    each = plan.model.batch // mesh.dp // microbatches
    return (f"tp {mesh.tp}, ep {mesh.ep}, pp {mesh.pp}{chunks}, dp {mesh.dp}; "
            f"{microbatches} x {each} seq. of {plan.model.seq:,}, {plan.schedule.pipeline}")


def refusal(path: Path, loaded) -> str:
    """What a plan that planc refuses states and planc has no key or value for: each
    refused statement as the plan writes it, in its block where the diagnostic names
    one. Only unknown keys and values are a refusal; any other error is a broken plan."""
    lines = path.read_text().splitlines()
    refused = []
    for d in loaded.diagnostics:
        if d.severity != "error":
            continue
        key = re.match(r"unknown key '(\w+)' in (\w+) \{ \}", d.message)
        value = re.match(r"unknown value '([^']+)'", d.message)
        assert key or value, (path.name, d.message)
        line = lines[d.span.line - 1]
        if key:
            stated = re.match(r"\s*=\s*([^;}\s]+)", line[d.span.end_column - 1:])
            refused.append(f"`{key[2]} {{ {key[1]} = {stated[1]} }}`")
        else:
            name = re.search(r"(\w+)\s*=\s*$", line[:d.span.column - 1])
            refused.append(f"`{name[1]} = {value[1]}`")
    return "planc has no " + ", ".join(refused)


def moe_rows(simulated) -> list[dict]:
    """One row per published run; ``simulated(path)``: ``planc simulate --json``'s dict.
    A plan planc refuses (it states what the run used that planc cannot express) has
    ``refused`` and no simulated figures."""
    rows = []
    for published in MOE_PUBLISHED:
        path = MOE_PLANS / f"{published.plan}.plan"
        loaded = load_file(path)
        if not loaded.ok:
            rows.append({"plan": published.plan, "run": published.run,
                         "source": published.source, "figure": published.figure,
                         "refused": refusal(path, loaded)})
            continue
        plan = loaded.plan
        data = simulated(path)
        tokens = plan.model.batch * plan.model.seq / data["step_seconds"] / plan.world
        expected = published.tokens_per_gpu(plan)
        exposed = [s["exposed_seconds"] for s in data["stages"]]
        ep = max(e.get("ep", 0.0) for e in exposed)
        dp = max(e.get("dp_cp", 0.0) + e.get("edp", 0.0) for e in exposed)
        rows.append({"plan": published.plan, "run": published.run, "gpus": plan.world,
                     "layout": layout(plan), "source": published.source,
                     "figure": published.figure, "published": expected,
                     "simulated": tokens, "error": tokens / expected - 1,
                     "mfu": data["mfu"], "ep": ep / data["step_seconds"],
                     "dp": dp / data["step_seconds"],
                     "step": data["step_seconds"], "refused": None})
    return rows


HEADER = ("| run (plans/moe-published/) | GPUs | layout | published | tokens/s per GPU: "
          "published | simulated | error | simulated step | MFU (planc's count) | exposed "
          "ep, dp and edp (worst stage) |")


def moe_table(rows: list[dict]) -> list[str]:
    lines = [HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["refused"]:
            lines.append(f"| {r['run']} (`{r['plan']}`) | | | {r['figure']}, {r['source']} "
                         f"| | refused: {r['refused']} | | | | |")
            continue
        lines.append(f"| {r['run']} (`{r['plan']}`) | {r['gpus']:,} | {r['layout']} | "
                     f"{r['figure']}, {r['source']} | {r['published']:,.0f} | "
                     f"{r['simulated']:,.0f} | {r['error']:+.1%} | {r['step']:.1f} s | "
                     f"{r['mfu']:.1%} | {r['ep']:.0%}, {r['dp']:.0%} |")
    return lines


def _documented() -> list[list[str]]:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"docs/simulate.md lacks the moe table: {REGENERATE}"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in block.strip().splitlines() if line.startswith("| ") and
            not line.startswith("| run")]


def _number(cell: str) -> float:
    return float(re.sub(r"[^0-9.+-]", "", cell))


def test_the_moe_table_of_docs_simulate_md_is_what_the_simulator_predicts():
    """Every row regenerated in process; the published and refused columns must match
    exactly, the simulated ones within 1 % (the doc rounds them); a change of the
    simulator beyond that needs the table regenerated (REGENERATE)."""
    rows = moe_rows(lambda path: simulate(compile_plan(load_file(path).plan)).to_json())
    documented = _documented()
    assert len(documented) == len(rows), REGENERATE
    for row, cells in zip(rows, documented):
        expected = moe_table([row])[2].strip().strip("|").split("|")
        expected = [cell.strip() for cell in expected]
        if row["refused"]:
            assert cells == expected, (row["plan"], REGENERATE)
            continue
        assert cells[:5] == expected[:5], (row["plan"], REGENERATE)
        for column in (5, 7):  # simulated tokens/s, simulated step
            assert _number(cells[column]) == pytest.approx(_number(expected[column]),
                                                           rel=0.01), (row["plan"], REGENERATE)
        assert _number(cells[6]) == pytest.approx(_number(expected[6]), abs=1.0), REGENERATE
    # the error planc simulate states beside a mixture's step is this table's, on the step
    from planc.simulate.accuracy import MIXTURES

    errors = sorted(abs(r["published"] / r["simulated"] - 1) for r in rows if not r["refused"])
    assert (MIXTURES.runs, MIXTURES.median, MIXTURES.largest) == (
        len(errors), round(statistics.median(errors), 3), round(errors[-1], 3))


# What each refused run used that planc cannot express, as its plan states it: none
# since optimize { moe_dispatcher = two_hop } writes DeepEP's dispatch.
REFUSED: dict[str, str] = {}


def test_the_published_moe_plans_are_valid_or_refused_naming_what_planc_lacks():
    """A run planc can express loads, and only planc's memory estimate warns (over 80 GB,
    mostly a mixture's activations, where the published runs fit; docs/simulate.md); a
    run that used what planc cannot express (DeepEP, DualPipe's overlap) is refused, on
    exactly those statements."""
    for published in MOE_PUBLISHED:
        path = MOE_PLANS / f"{published.plan}.plan"
        loaded = load_file(path)
        assert path.read_text().startswith(f"# {published.plan}: ")
        if published.plan in REFUSED:
            assert not loaded.ok
            assert refusal(path, loaded) == REFUSED[published.plan]
            continue
        assert loaded.ok, [d.message for d in loaded.diagnostics]
        assert all(d.message.startswith("estimated memory per device")
                   for d in loaded.diagnostics), [d.message for d in loaded.diagnostics]


def test_the_qwen3_235b_imbalance_is_the_modelzoos_measurement_through_the_simulator():
    """bench/moe_imbalance.py: the measured 295 / 237 = 1.245 times the balanced step
    falls between the long-context layout's simulated steps at imbalance 1.99 and 2.01,
    and the plans of that benchmark taken as dropless state 2.0; the ep 32 layout, which
    the ModelZoo's run_235b.sh runs with --moe-router-force-load-balancing, 1.0."""
    from bench.moe_imbalance import DROPLESS_TFLOPS, FORCED_BALANCE_TFLOPS, step_seconds

    balanced = step_seconds(1.0)
    measured = FORCED_BALANCE_TFLOPS / DROPLESS_TFLOPS
    assert step_seconds(1.99) / balanced < measured < step_seconds(2.01) / balanced
    for plan, imbalance in (("modelzoo-qwen3-235b-a2a", "2.0"),
                            ("modelzoo-qwen3-235b-tp4", "2.0"),
                            ("modelzoo-qwen3-235b-ep32", "1.0"),
                            ("modelzoo-qwen3-235b-ep32-overlap", "1.0")):
        assert f"imbalance = {imbalance}\n" in (MOE_PLANS / f"{plan}.plan").read_text()


def test_megatron_counts_mixtral_as_planc_does_but_for_the_router():
    m = load_file(MOE_PLANS / "mcore-mixtral-8x7b.plan").plan.model
    from planc.models.moe import model_flops_per_token

    router = 2 * m.hidden * m.experts * m.layers
    assert megatron_flops_per_token(m, causal=False) == 3 * (model_flops_per_token(m) - router)


# --- the all-to-all ------------------------------------------------------------------------

def test_an_all_to_all_is_priced_on_where_its_ranks_sit():
    """dgx-h100 at what NCCL achieves: NVLink 370 GB/s and 3.4 us a step, one 47 GB/s
    NIC per GPU and 9.6 us (planc.plan.presets). Each rank sends B = 64 MB in all, B / n
    to each member. 8 ranks of one node: 7/8 B over NVLink. 32 ranks on 4 nodes of 8:
    7/32 B over NVLink and, at once, 24/32 B over its NIC. 16 ranks, one per node: 15/16 B
    over the NIC."""
    plan = load_text("plan p { model gpt { layers = 2; hidden = 64; heads = 4; vocab = 128; "
                     "seq = 16; batch = 8 }\n"
                     "topology { preset = dgx-h100; devices_per_node = 1 } }").plan
    cost, b = CostModel(plan.topology), 64e6
    nvlink, nic = 370e9, 50e9 * 47 / 50
    assert cost.all_to_all_seconds(b, Placement.within_node(8)) == 3.4e-6 + 7 / 8 * b / nvlink
    four_nodes = Placement.of_counts(counts_of(range(32), 8))
    assert cost.all_to_all_seconds(b, four_nodes) == 9.6e-6 + 24 / 32 * b / nic
    spread = Placement.of_counts((1,) * 16)
    assert cost.all_to_all_seconds(b, spread) == 9.6e-6 + 15 / 16 * b / nic
    assert cost.all_to_all_seconds(b, Placement.within_node(1)) == 0.0


TWO_NODES = """plan p {{
  model moe {{ layers = 2; hidden = 64; heads = 4; kv_heads = 2; vocab = 128; seq = 16;
              batch = 16; experts = 16; top_k = 2; expert_ffn = 32; dtype = bf16 }}
  mesh {{ dp = 16; ep = {ep}; order = [{order}] }}
  topology {{ preset = dgx-h100 }}
}}"""


@pytest.mark.parametrize("ep, order, placement", [
    (8, "tp, cp, dp, pp", Placement.within_node(8)),
    (16, "tp, cp, dp, pp", Placement.of_counts((8, 8)))])
def test_the_step_charges_each_mixtures_all_to_alls_to_the_ep_axis(ep, order, placement):
    """dp 16 on two nodes, one sequence each: a rank dispatches 16 tokens x top_k 2 rows of
    64 bf16 features (4 KB), the busiest rank 1.72 times that (the default imbalance);
    each of the 2 mixtures runs 2 all-to-alls forward and 2 backward, and before its
    forward's dispatch one of its counts (16 experts x 8 bytes); the step's exposed ep is
    those 10, priced on the group's placement."""
    build = compile_plan(load_text(TWO_NODES.format(ep=ep, order=order)).plan)
    result = simulate(build)
    cost = CostModel(build.plan.topology)
    one = cost.all_to_all_seconds(16 * 2 * 64 * 2 * 1.72, placement)
    counts = cost.all_to_all_seconds(16 * 8, placement)
    assert result.stages[0].exposed_seconds["ep"] == pytest.approx(8 * one + 2 * counts,
                                                                   rel=1e-12)


# --- the experts' kernels ------------------------------------------------------------------

def test_a_grouped_gemm_fills_the_waves_with_every_experts_tiles():
    """16 experts of 1024 x 1536 on 132 SMs: alone, one expert's 96 tiles of 128x128 fill
    96 of a wave's 132; grouped, their 1,536 tiles fill 1,536 of 12 waves (1,584)."""
    assert wave_efficiency(1024, 1536, 132) == 96 / 132
    assert wave_efficiency(1024, 1536, 132, 16) == 1536 / 1584


def test_a_mixture_is_priced_by_its_grouped_gemms_and_its_traffic():
    """mcore-mixtral-8x7b: a microbatch of 4,096 tokens (tp 1), 2 rows each, ep 8 over 8
    experts: each rank's one expert gets 8 x 4096 x 2 / 8 = 8,192 rows at the mean, the
    busiest 1.72 times that (the default imbalance). Forward: the
    router (4096 x 8, inner 4,096), gate and up (8192 x 28,672, inner 4,096), down (8192 x
    4,096, inner 14,336); between them the rows permuted (read and written), unpermuted
    (rows read, tokens written), the activation (two rows of 14,336 read, one written), in
    bf16, and the fp32 probabilities written and read; 5 launches besides the GEMMs'."""
    build = compile_plan(load_file(MOE_PLANS / "mcore-mixtral-8x7b.plan").plan)
    kernels = KernelModel.of(build.plan)
    program = next(p for p in build.programs.values() if p.stage == 0)
    found = {i.node: i for block in program.blocks.values() for i in block}
    forward, backward = found["F/L4/moe"].operands, found["B/L4/moe"].operands
    rows, tokens, h, e = 8192 * 1.72, 4096, 4096, 14336
    moved = 2 * (rows * 2 * h + rows * h + tokens * h + rows * 3 * e) + 2 * 4 * tokens * 8
    assert kernels.seconds(forward, 0.0) == pytest.approx(
        kernels.gemm_seconds(tokens, 8, h) + kernels.grouped_gemm_seconds(1, rows, 2 * e, h)
        + kernels.grouped_gemm_seconds(1, rows, h, e) + moved / 3.35e12 + 5 * 4e-6,
        rel=1e-12)
    # The backward: input gradients of gate-and-up (inner 28,672) and down (inner 4,096),
    # their weight gradients (inner: the expert's 8,192 rows), the router's two; twice
    # the traffic and the launches.
    assert kernels.seconds(backward, 0.0) == pytest.approx(
        kernels.grouped_gemm_seconds(1, rows, h, 2 * e) + kernels.grouped_gemm_seconds(
            1, rows, e, h) + kernels.grouped_gemm_seconds(1, h, 2 * e, rows)
        + kernels.grouped_gemm_seconds(1, e, h, rows) + kernels.gemm_seconds(tokens, h, 8)
        + kernels.gemm_seconds(h, 8, tokens) + 2 * moved / 3.35e12 + 10 * 4e-6, rel=1e-12)
    assert kernels.grouped_gemm_seconds(1, rows, h, e) == kernels.gemm_seconds(rows, h, e)

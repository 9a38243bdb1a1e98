"""Plans at planc's limits (docs/language.md, section 5, Limits), shared by
tests/test_limits.py (refused one past each limit), tests/test_limits_compiled.py (every
command on the plans at the limits, in bounded work and memory) and bench/limits.py (how
long each command takes on them)."""

from __future__ import annotations

from dataclasses import dataclass

from planc.lang.check import LIMITS


def gpt(layers: int, *, pp: int = 1, dp: int = 1, tp: int = 1, cp: int = 1,
        microbatches: int = 1, virtual: int = 1, family: str = "gpt", extra: str = "",
        shard: str = "") -> str:
    """A small-width plan: compile time depends on the counts, not on the widths."""
    heads = max(4, tp)
    model = (f"layers = {layers}; hidden = {16 * heads}; heads = {heads}; "
             + (f"kv_heads = {heads // 2}; ffn = {48 * heads}; " if family == "llama" else "")
             + f"vocab = {max(256, 128 * tp)}; seq = {max(32, 2 * cp * tp)}; "
             f"batch = {dp * microbatches}; dtype = fp32")
    pipeline = "interleaved" if virtual > 1 else "1f1b"
    world = tp * cp * pp * dp
    return (f"plan limits {{\n  model {family} {{ {model} }}\n"
            f"  mesh {{ tp = {tp}; cp = {cp}; pp = {pp}; dp = {dp} }}\n"
            f"  topology {{ devices_per_node = {8 if world % 8 == 0 else world} }}\n"
            f"  shard {{ {shard}pp {{ virtual = {virtual} }} }}\n"
            f"  schedule {{ microbatches = {microbatches}; pipeline = {pipeline} }}\n"
            f"{extra}}}\n")


@dataclass(frozen=True)
class AtTheLimits:
    """A plan at the limits and the read-only commands run on its build (``build``)."""

    text: str
    commands: tuple[tuple[str, ...], ...]
    layers: int
    pp: int
    world: int
    chunks_per_stage: int
    microbatches: int


LAST_RANK = LIMITS["world"] - 1

# 1,024 layers, 524,288 ranks, 65,536 microbatches and pp x microbatches = 131,072:
# every limit at once.
EVERY_LIMIT = AtTheLimits(
    gpt(LIMITS["layers"], pp=2, dp=LIMITS["world"] // 2, microbatches=LIMITS["microbatches"]),
    (("programs", "build", "--rank", str(LAST_RANK), "--expand"), ("verify", "build"),
     ("graph", "build", "-o", "graph.html")),
    LIMITS["layers"], 2, LIMITS["world"], 1, LIMITS["microbatches"])

# Interleaved: pp x virtual = 1,024 chunks of one layer, pp x virtual x microbatches at
# its limit.
MOST_CHUNKS = AtTheLimits(
    gpt(LIMITS["layers"], pp=2, virtual=512, microbatches=128),
    (("verify", "build"), ("programs", "build", "--rank", "1", "--expand", "--microbatch", "127"),
     ("simulate", "build")),
    LIMITS["layers"], 2, 2, 512, 128)

# The most nodes per layer (llama; tp, cp and sequence parallelism; ZeRO-3; full
# recomputation) on 1,024 layers in 1,024 stages, pp x microbatches at its limit.
HEAVIEST = AtTheLimits(
    gpt(LIMITS["layers"], pp=1024, tp=8, cp=2, dp=2, microbatches=128, family="llama",
        shard="tp { sequence_parallel = on }; dp { zero = 3 }; ",
        extra="  optimize { recompute = full }\n"),
    (("verify", "build"), ("programs", "build", "--rank", "5", "--expand"),
     ("graph", "build", "-o", "graph.html")),
    LIMITS["layers"], 1024, 8 * 2 * 1024 * 2, 1, 128)

AT_THE_LIMITS = {"every limit": EVERY_LIMIT, "most model chunks": MOST_CHUNKS,
                 "heaviest layout": HEAVIEST}

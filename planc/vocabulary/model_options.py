"""What some of a model's optional keys mean in numbers, read alike by the compiler and
its checks (planc.models), the simulator and the runtime, which reads the build and never
the models: FP8's scaling tile and the bytes an FP8 element takes, a mixture's expert
groups and its experts' capacity. Pure functions of a model's keys (``m.options`` and
the sizes), torch-free and models-free.
"""

from __future__ import annotations

import math

FP8_TILE = 128  # DeepSeek-V3's scaling tile (DeepSeek-AI 2024, section 3.3.1)


def fp8_tile(m) -> int | None:
    """The scaling tile of ``m``'s FP8 GEMMs, or None when it multiplies in its dtype."""
    if m.options.get("fp8") is None:
        return None
    return m.options.get("fp8_tile") or FP8_TILE


def gemm_input_bytes(m) -> float:
    """Bytes per element of a GEMM input as it is kept and moved: the dtype's, or with
    ``fp8`` one E4M3 byte and its tile's fp32 scale, 4 / fp8_tile (DeepSeek-AI 2024,
    section 3.3: the activations a linear caches for its backward, and a mixture's
    dispatched rows, are FP8)."""
    tile = fp8_tile(m)
    return m.dtype_bytes if tile is None else 1.0 + 4.0 / tile


def expert_groups_of(m) -> tuple[int, int] | None:
    """(expert_groups, route_groups) of DeepSeek-V3's group-limited routing (every group
    when route_groups is not written, one group when expert_groups is not), or None."""
    groups, chosen = m.options.get("expert_groups"), m.options.get("route_groups")
    if groups is None and chosen is None:
        return None
    groups = groups or 1
    return groups, groups if chosen is None else chosen


def balance_bias_name(layer: int) -> str:
    """The balancing bias of block ``layer`` (``bias_update``), as the rank's state and
    checkpoints name it (Megatron-Core keeps it as the router's ``expert_bias`` buffer)."""
    return f"layers.{layer}.router.balance_bias"


def balanced_layers(m) -> range:
    """The blocks of ``m`` that keep a balancing bias: its mixtures, none without
    ``bias_update``."""
    if m.options.get("bias_update") is None or m.options.get("experts") is None:
        return range(0)
    return range(m.first_dense, m.layers)


def balance_bias_names(m) -> list[str]:
    """The balancing bias of every mixture block of ``m``, none without ``bias_update``."""
    return [balance_bias_name(layer) for layer in balanced_layers(m)]


def expert_capacity(m) -> int | None:
    """How many of a sequence's tokens each expert takes with ``capacity = F``:
    ceil(F x seq x top_k / experts) (GShard's expert capacity, Lepikhin et al. 2021, per
    sequence), None without dropping."""
    factor = m.options.get("capacity")
    return None if factor is None else math.ceil(factor * m.seq * m.top_k / m.experts)

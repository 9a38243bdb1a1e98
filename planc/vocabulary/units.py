"""Units of quantities: sizes, bandwidths, times and compute rates, converted to SI.

Decimal prefixes are powers of 1000 (KB, MB, GB) and binary ones powers of 1024
(KiB, MiB, GiB), as in the IEC 80000-13 convention that NCCL and vendors use for
link bandwidths and memory sizes respectively.
"""

from __future__ import annotations

SIZE, RATE, TIME, COMPUTE = "size", "bandwidth", "time", "compute rate"

_DECIMAL = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}


def _build() -> dict[str, tuple[str, float]]:
    units: dict[str, tuple[str, float]] = {}
    for prefix, scale in (_DECIMAL | _BINARY).items():
        units[f"{prefix}B"] = (SIZE, scale)
        units[f"{prefix}B/s"] = (RATE, scale)
    for prefix, scale in _DECIMAL.items():
        units[f"{prefix}bit/s"] = (RATE, scale / 8)
        units[f"{prefix}FLOP/s"] = (COMPUTE, scale)
    units.update({"ns": (TIME, 1e-9), "us": (TIME, 1e-6), "ms": (TIME, 1e-3), "s": (TIME, 1.0)})
    return units


UNITS: dict[str, tuple[str, float]] = _build()

EXAMPLES = {SIZE: "25MB", RATE: "50GB/s", TIME: "5us", COMPUTE: "312TFLOP/s"}

# What a plan's quantities and a calibrated topology's figures may be: far beyond any
# device or link that exists (an H100's 3.35 TB/s and 989 TFLOP/s, latencies of
# microseconds), and near enough that the cost model's sums and differences of them stay
# exact to far below a kernel's time (a latency of 1e30 s made a step minus its exposed
# communication come out negative, one of 1e308 s infinite).
MAX_RATE, MAX_SECONDS = 1e30, 3600.0
RANGES = {SIZE: (1.0, MAX_RATE), RATE: (1.0, MAX_RATE), COMPUTE: (1.0, MAX_RATE),
          TIME: (0.0, MAX_SECONDS)}
SI_UNITS = {SIZE: "B", RATE: "B/s", TIME: "s", COMPUTE: "FLOP/s"}  # what RANGES count in
# A plain number's magnitude, where it is not 0 (a plan's real numbers, a metrics file's
# figures): the product or quotient of two stays a finite float.
SMALLEST, LARGEST = 1e-100, 1e100


def units_of(dimension: str) -> list[str]:
    return [name for name, (dim, _) in UNITS.items() if dim == dimension]


def format_bytes(n: float) -> str:
    """Human-readable decimal size: 1.9 GB, 120 GB, 512 B."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def format_quantity(value: float, dimension: str) -> str:
    if dimension == SIZE:
        return format_bytes(value)
    if dimension == RATE:
        return format_bytes(value) + "/s"
    if dimension == TIME:
        for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
            if value >= scale:
                return f"{value / scale:.3g} {unit}"
        return f"{value / 1e-9:.3g} ns"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} FLOP/s"


def format_flops(count: float) -> str:
    """A number of floating-point operations with its unit: '3.22 TFLOP'."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                        ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} FLOP"


def format_flop_rate(flops_per_second: float) -> str:
    """A FLOP rate in the unit that shows it: '420.4 TFLOP/s' on a GPU (one decimal, as
    Megatron-LM reports it), '11.6 GFLOP/s' on a CPU of a calibrated topology, which
    would print as 0.0 TFLOP/s."""
    if flops_per_second >= 1e12:
        return f"{flops_per_second / 1e12:,.1f} TFLOP/s"
    for unit, scale in (("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3)):
        if flops_per_second >= scale:
            return f"{flops_per_second / scale:.3g} {unit}"
    return f"{flops_per_second:.3g} FLOP/s"


def format_share(fraction: float) -> str:
    """A percentage with one decimal, or two significant digits below 1% (a small model
    on a large device), so that it never reads 0.0% unless it is 0."""
    if fraction == 0 or fraction >= 0.01:
        return f"{fraction:.1%}"
    return f"{100 * fraction:.2g}%"


"""Keep the memory a training step frees for the next step, on glibc.

Every step allocates and frees the same activations, gradients and saved tensors. With
glibc's defaults, blocks of 128 KiB and more come from ``mmap`` until a free raises that
threshold, and whenever more than the trim threshold is free at the top of the heap it
goes back to the kernel; the next step then takes a page fault for every 4 KiB page it
touches again. Measured on the 1-rank bench model (bench/peers.py: gpt, 4 layers,
hidden 256): about 24,000 minor faults a step and 460 ms, against 2 and 410 ms with
the settings below. A thread other than the main one allocates from an arena of its
own, made of 64 MiB heaps that glibc unmaps as soon as they are empty, whatever the
thresholds say; the program's streams are threads (planc.runtime.engine.executor), so every
thread shares the main heap (one arena: the stream threads allocate few, large blocks,
so they hardly contend for its lock). A thread that allocates before the limit is set
gets an arena of its own, which glibc then hands to later threads in turn, so each entry
of a rank asks before it starts any thread (planc.runtime.launcher.rank_process under
planc run, planc.runtime.worker's ``main`` under torchrun): the launcher's watch,
started first, had got one, the stream threads shared it, and a dp 2 step of
bench/peers.py's model took 4,400 to 7,200 faults again (tests/test_run_metrics.py;
``page_faults`` in the metrics, docs/metrics.md). PyTorch's CPU performance guide gives the same advice
(a caching allocator such as jemalloc or tcmalloc, or these glibc settings); CUDA's
caching allocator does this for device memory.

Nothing happens where the C library is not glibc: the run is then as fast as its
allocator makes it, and as correct.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc refuses an mmap threshold above half its largest heap (32 MiB on 64-bit);
# blocks larger than this still come from mmap and go back when freed.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; True if it accepted."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator be
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all([bool(mallopt(option, value)) for option, value in settings])

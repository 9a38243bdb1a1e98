"""torch on one thread, for the work planc run's launcher does itself.

The launcher checks a checkpoint's values and scans a token file before any rank starts.
On one thread, that work leaves the cores to the ranks, and the process never starts
torch's pool of intra-op (OpenMP) threads: a process that forks after the pool started
gives its children a pool whose threads are gone, and the first parallel operator of a
child then waits for them forever (seen with torch.multiprocessing's ``fork``)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

"""torch's intra-op threads: one for the work planc run's launcher does itself, and a
thread's own count inside a rank.

The launcher checks a checkpoint's values and scans a token file before any rank starts.
On one thread, that work leaves the cores to the ranks, and the process never starts
torch's pool of intra-op (OpenMP) threads: a process that forks after the pool started
gives its children a pool whose threads are gone, and the first parallel operator of a
child then waits for them forever (seen with torch.multiprocessing's ``fork``).

Inside a CPU rank the compute stream's thread alone computes with more than one
(planc.runtime.engine.executor says why): every other thread asks for one."""

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


def own_intra_op_threads(count: int) -> None:
    """Give the calling thread ``count`` intra-op threads for its own operators.

    torch sets a thread's count on that thread's first operator, from a value every
    thread shares; reading it first makes that happen now, so that the count set after it
    is this thread's and no later ``set_num_threads`` of another thread moves it
    (tests/test_intra_op_threads.py)."""
    import torch

    torch.get_num_threads()  # this thread's first read: from now on its count is its own
    torch.set_num_threads(count)

"""What planc run's fork server does before it forks any rank (gloo on CPUs, where ranks
are forked: planc.runtime.launcher.launch preloads this module).

- It imports what every rank would otherwise import after its fork, each paying again:
  the worker with torch, and the module of symbolic shapes (with sympy) that
  ``torch.autograd.grad`` imports on a rank's first backward that is given the output's
  gradient, 1 s of CPU per rank; and the oracle of ``planc run --check``, which
  imports the model's families and the memory estimate (70 ms here, once, against as
  much in each rank of a checked run).
- Then it freezes its heap out of CPython's cyclic collector (``gc.freeze``), as the gc
  module's documentation advises for a process that forks without exec. Otherwise every
  rank's collections of the oldest generation scan the hundreds of thousands of objects
  it inherited, and touching each object's header copies its page into the rank: three
  8-rank runs of 2 steps with ``--check``, interleaved over 3 rounds, took 21.6-26.3
  CPU-seconds with the heap unfrozen, 18.1-19.8 frozen (12.5-16.6 once the oracle was
  preloaded too). Freezing it in the rank instead gains nothing: the rank's start, before
  its own code runs (multiprocessing unpickling the rank's arguments), already collects.
"""

import gc

import planc.runtime.oracle.check  # noqa: F401
import planc.runtime.oracle.reference  # noqa: F401
import planc.runtime.worker  # noqa: F401
import torch.fx.experimental.symbolic_shapes  # noqa: F401

gc.freeze()

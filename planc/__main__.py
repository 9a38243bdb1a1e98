"""``python -m planc`` and the ``planc`` command.

Until the command line installs its own handlers (planc.host.interrupts), a Ctrl-C ends planc
at once and quietly: at this point nothing has started, and a traceback from the middle
of an import would only tell a user that planc was loading. The handler is installed
before anything else is imported: ``_signal`` is built into the interpreter, and ``os``
and ``sys`` are loaded by Python's own start-up.
"""

import _signal
import os
import sys


def _interrupted_while_starting(signum, frame) -> None:
    print(f"\nplanc: interrupted by signal {signum}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def run() -> None:
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    from planc.cli import main

    sys.exit(main())


if __name__ == "__main__":
    run()

"""One piece of checkpoint work at a time in a thread of its own, its error kept for the
next wait (``--checkpoint-async``: planc.runtime.checkpoint.checkpoints and peer_memory)."""

from __future__ import annotations

import threading
from typing import Callable

from planc.runtime.launcher.torch_threads import own_intra_op_threads


class Background:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self, work: Callable, args: tuple, name: str) -> None:
        """Run ``work(*args)`` in a thread, once the previous work is done."""
        self.wait()
        self._thread = threading.Thread(target=self._catching, args=(work, args), name=name,
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the work started last is done; its error, if it failed, is raised here."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _catching(self, work: Callable, args: tuple) -> None:
        # beside the training's compute stream: a team of its own would slow it
        # (planc.runtime.engine.executor)
        own_intra_op_threads(1)
        try:
            work(*args)
        except BaseException as exc:  # SystemExit too: raised on the main thread by wait()
            self._failure = exc

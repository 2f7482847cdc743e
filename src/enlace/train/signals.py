"""SIGTERM/SIGINT during training: finish the current step, save a checkpoint, stop."""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopFlag:
    """SIGTERM/SIGINT ask the loop to finish the current step, checkpoint and return."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the checkpoint
        self.signal = signal.Signals(signum).name

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

"""SIGTERM/SIGINT during training: finish the current step, save a checkpoint, stop."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from ..errors import EnlaceError


class SecondInterrupt(KeyboardInterrupt):
    """Ctrl-C again while the first one's checkpoint is pending: the user does not want to wait."""


class SaveAbandoned(EnlaceError):
    """Interrupted twice: the run stopped without saving its current step. Exit status 1, not 130, which
    means "stopped after saving"."""

    exit_code = 1


def abandoned(step: int, checkpoints: list[Path]) -> SaveAbandoned:
    last = f"the last complete checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was saved"
    return SaveAbandoned(
        f"interrupted twice: stopped at step {step} without saving it; {last} (a rerun continues from there)"
    )


class StopFlag:
    """SIGTERM/SIGINT ask the loop to finish the current step, checkpoint and return."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise SecondInterrupt  # the user does not want to wait for the checkpoint
        self.signal = signal.Signals(signum).name

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

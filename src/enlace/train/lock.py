"""One process per run directory: an exclusive lock that dies with its process.

The lock is flock(2) on `.<run dir name>.lock` beside the run directory (outside it, so `--fresh` can delete
the directory while holding the lock). The kernel drops it when the process exits, however it exits, so a
SIGKILL never leaves a stale lock. The file holds the holder's pid, for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import EnlaceError
from ..io import require_folder

_held: dict[Path, int] = {}  # lock files this process holds -> fd (re-entrant within the process)


class RunDirBusy(EnlaceError):
    """Another process is training in this run directory."""


def lock_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir).absolute()
    return run_dir.parent / f".{run_dir.name}.lock"


@contextmanager
def run_dir_lock(run_dir: Path, enabled: bool = True) -> Iterator[None]:
    """Hold the run directory's lock for the block; refuse at once if another process holds it.

    enabled=False (the non-main ranks of a data-parallel run, which share the main rank's directory)
    makes it a no-op.
    """
    path = lock_path(run_dir)
    if not enabled or path in _held:
        yield
        return
    require_folder(Path(run_dir), "run directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise EnlaceError(
            f"{path}: cannot create the run directory's lock file ({e.strerror or e})"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(
            f"{run_dir}: another enlace process (pid {holder}) is running in this directory; wait for it "
            "to finish, stop it, or choose another run directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
    try:
        check_writable(run_dir)
        yield
    finally:
        del _held[path]
        os.close(fd)  # closing the last descriptor releases the lock


def check_writable(run_dir: Path) -> None:
    """Fail at once, in one line, where the run could not save anything."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise EnlaceError(
            f"{run_dir}: cannot write in the run directory ({e.strerror or e}); fix its permissions or "
            "choose another one"
        ) from None

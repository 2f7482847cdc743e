"""Run identity: a hash of everything that decides the weights, and what a rerun does with an old run.

Every checkpoint stores `identity` (the hash) and `identity_keys` (the flat values it hashes). A run resumes
only a checkpoint of its own identity. Otherwise:
- only the step count changed (train.max_steps, finetune.max_steps): the weights at step s are the same in both
  runs as long as both were still before their decay (WSD's plateau does not depend on the step count), so
  the run resumes from the last checkpoint at or before both decay starts, which the trainer pins. Later
  checkpoints are archived. Without such a checkpoint it starts fresh.
- anything else changed: the old run is archived and the run starts fresh, saying which keys changed.
Archiving moves the old run to <run dir>/previous/<old identity>/ (or deletes it: on_change "delete").
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config.resolve import flatten, stable_hash
from ..io import fsync_dir
from .checkpoint import META, list_checkpoints, step_of

PREVIOUS = "previous"


@dataclass(frozen=True)
class RunIdentity:
    keys: dict[str, Any]  # flat, dotted: the values that decide the weights
    steps_key: str  # the key holding the step count (train.max_steps or finetune.max_steps)

    @property
    def hash(self) -> str:
        return stable_hash(self.keys)


def weight_keys(sections: dict[str, Any], ignore: Iterable[str]) -> dict[str, Any]:
    """Flatten config sections to dotted keys, dropping those under an ignored prefix."""
    ignore = tuple(ignore)
    flat = flatten(sections)
    return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p + ".") for p in ignore)}


def code_fingerprint(modules: Iterable[ModuleType]) -> str:
    """sha256 over the source of the modules that compute a step: a code change makes a new run."""
    h = hashlib.sha256()
    for m in sorted(modules, key=lambda m: m.__name__):
        h.update(m.__name__.encode() + b"\0")
        h.update(Path(inspect.getsourcefile(m) or "").read_bytes())
    return h.hexdigest()[:16]


SHOWN_CHARS = 60  # a value longer than this is cut in the message: the key already says where to look


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _describe(key: str, old: Any, new: Any) -> str:
    """One readable change: named entries (data sources) by name, anything else as old -> new, cut short."""
    named = isinstance(old, list) and isinstance(new, list)
    named = named and all(isinstance(x, dict) and "name" in x for x in [*old, *new])
    if not named:
        if isinstance(old, str) and isinstance(new, str):
            # Long texts that share a start (runtime.numerics: "torch ...; vendor (flags); N threads") are
            # shown from the last "; " before they part, so the cut keeps what changed.
            part = old.rfind("; ", 0, len(os.path.commonprefix([old, new]))) + 2
            if part > 1:
                old, new = "..." + old[part:], "..." + new[part:]
        return f"{key}: {_shown(old)} -> {_shown(new)}"
    before, after = {x["name"]: x for x in old}, {x["name"]: x for x in new}
    parts = [
        f"{what} {', '.join(names)}"
        for what, names in (
            ("added", [n for n in after if n not in before]),
            ("removed", [n for n in before if n not in after]),
            ("changed", [n for n in after if n in before and after[n] != before[n]]),
        )
        if names
    ]
    return f"{key}: {'; '.join(parts) or 'reordered'}"


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        _describe(k, old.get(k, "<unset>"), new.get(k, "<unset>"))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a checkpoint without verifying it (loading verifies); None when unreadable."""
    try:
        return json.loads((Path(path) / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def archive(run_dir: Path, names: Iterable[str], old_identity: str, on_change: str) -> Path | None:
    """Move (or delete) the named entries of run_dir to run_dir/previous/<old identity>[.N]/."""
    present = [run_dir / n for n in names if (run_dir / n).exists()]
    if on_change == "delete":
        for p in present:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return None
    dest = run_dir / PREVIOUS / old_identity
    n = 1
    while dest.exists():  # an earlier archive of the same identity stays as it was
        dest = run_dir / PREVIOUS / f"{old_identity}.{n}"
        n += 1
    dest.mkdir(parents=True)
    for p in present:
        p.rename(dest / p.name)
    fsync_dir(run_dir)
    return dest


def reconcile(
    run_dir: Path,
    ckpt_dir: str,
    ident: RunIdentity,
    decay_start: Callable[[dict[str, Any]], int],
    run_files: Iterable[str],
    on_change: str = "move",
) -> str | None:
    """Leave in run_dir/ckpt_dir only checkpoints this run may resume; return a message saying what changed.

    decay_start(keys): the first step whose learning rate depends on the step count, for identity keys.
    run_files: the run's other outputs, archived with its checkpoints when the run starts fresh.
    """
    run_dir = Path(run_dir)
    root = run_dir / ckpt_dir
    done = list_checkpoints(root)
    if not done:
        return None
    meta = read_meta(done[-1])
    if meta is None or meta.get("identity") == ident.hash:
        return None  # the same run (or an unreadable meta.json, which loading reports)
    old_keys = meta.get("identity_keys") or {}
    old_id = meta.get("identity") or "unknown"
    changes = changed_keys(old_keys, ident.keys) if old_keys else ["written before run identities existed"]
    if changes and all(c.startswith(ident.steps_key + ":") for c in changes):
        limit = min(decay_start(old_keys), decay_start(ident.keys))
        keep = [p for p in done if step_of(p) <= limit]
        if keep:
            later = [p for p in done if step_of(p) > limit]
            if later:
                dest = run_dir / PREVIOUS / old_id / ckpt_dir
                if on_change == "delete":
                    for p in later:
                        shutil.rmtree(p)
                else:
                    dest.mkdir(parents=True, exist_ok=True)
                    for p in later:
                        shutil.rmtree(dest / p.name, ignore_errors=True)
                        p.rename(dest / p.name)
            return (
                f"{changes[0]}: resuming from {keep[-1].name}, the last checkpoint before the learning-rate "
                f"decay of both runs (steps up to there are the same)"
            )
    where = archive(run_dir, [ckpt_dir, *run_files], old_id, on_change)
    kept = f"moved to {where}" if where is not None else "deleted (on_change: delete)"
    return (
        f"starting fresh: the checkpoints in {root} belong to another run (identity {old_id}, now "
        f"{ident.hash}): {'; '.join(changes[:8])}{f' and {len(changes) - 8} more' if len(changes) > 8 else ''}. The old run was {kept}"
    )

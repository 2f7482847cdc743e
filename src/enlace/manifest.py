"""manifest.json: what an artifact holds (each file's size and sha256) and where it came from.

Every artifact folder ENLACE writes (LoRA adapters, exported and imported Hugging Face folders, the run's
tokenizer) gets one, written last inside the folder's atomic write (io.atomic_dir). A GGUF is one file, so
its manifest is a sidecar beside it: `model.gguf.manifest.json`. Loaders verify before they read: sizes
first (cheap, and a truncated file fails at once), then sha256; a mismatch is one line naming the file.

Unlisted files: a loader that reads a file the manifest does not list refuses it (it was added after the
folder was written). A full check (`enlace verify`) also refuses unlisted weight files (.safetensors, .gguf,
.bin, .pt, .pth, .model), which a loader could be pointed at; other extra files (a README, export.json) are
allowed. A folder without a manifest (written before manifests existed) loads with a one-line warning, once
per folder and process; `enlace verify PATH --write` adopts it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import DataError
from .io import atomic_write_json, sha256_file

MANIFEST = "manifest.json"
SIDECAR_SUFFIX = ".manifest.json"
FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".model")

log = logging.getLogger("enlace.manifest")
_warned: set[str] = set()


class ManifestError(DataError):
    """An artifact's files do not match its manifest (changed, corrupt, missing or added)."""


def sidecar(path: Path) -> Path:
    """Where a single file's manifest lives: `x.gguf` -> `x.gguf.manifest.json`."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _listable(folder: Path) -> list[str]:
    # Temporary and hidden files (atomic writes in progress) are never part of an artifact.
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )


def _entries(base: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {n: {"size": (base / n).stat().st_size, "sha256": sha256_file(base / n)} for n in names}


def _document(kind: str, provenance: dict[str, Any] | None, files: dict[str, Any]) -> dict[str, Any]:
    from . import __version__

    return {
        "manifest": FORMAT,
        "kind": kind,
        "enlace_version": __version__,
        "provenance": {k: v for k, v in (provenance or {}).items() if v is not None},
        "files": files,
    }


def hash_folder(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of `folder` (its manifest's `files`), by path relative to it."""
    return _entries(Path(folder), _listable(Path(folder)))


def write_manifest(
    folder: Path,
    kind: str,
    provenance: dict[str, Any] | None = None,
    files: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write `folder`'s manifest.json (atomically), hashing every file unless `files` (hash_folder's answer)
    is given. Call it after the last file is written."""
    folder = Path(folder)
    doc = _document(kind, provenance, files if files is not None else hash_folder(folder))
    atomic_write_json(folder / MANIFEST, doc)
    return doc


def write_file_manifest(path: Path, kind: str, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sidecar manifest of one file (a GGUF), written after the file is in place."""
    path = Path(path)
    doc = _document(kind, provenance, _entries(path.parent, [path.name]))
    atomic_write_json(sidecar(path), doc)
    return doc


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest file, parsed and checked for shape; a bad one is a ManifestError naming it."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: unreadable manifest ({e})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        raise ManifestError(f"{path}: not an ENLACE manifest (no files with size and sha256)")
    for name in files:
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or "\\" in name:
            raise ManifestError(f"{path}: file name {name!r} leaves the folder; refused")
    return doc


def recorded_provenance(folder: Path) -> dict[str, Any]:
    """The provenance a folder's manifest records ({} without one); no check: the loader verified it."""
    path = Path(folder) / MANIFEST
    return dict(read_manifest(path).get("provenance") or {}) if path.is_file() else {}


def _warn_legacy(what: Path, hint: Path) -> None:
    key = str(Path(what).resolve())
    if key not in _warned:
        _warned.add(key)
        log.warning(
            f"warning: {what}: no manifest (written before manifests existed, or by another tool), not verified; "
            f"`enlace verify {hint} --write` adopts it"
        )


def _check(base: Path, manifest: Path, doc: dict[str, Any], names: list[str]) -> None:
    """Existence and size of every name first (cheap), then sha256."""
    files = doc["files"]
    for n in names:
        if not (base / n).is_file():
            raise ManifestError(f"{base / n}: missing (listed in {manifest.name})")
    for n in names:
        size = (base / n).stat().st_size
        if size != files[n]["size"]:
            raise ManifestError(
                f"{base / n}: size {size} does not match {manifest.name} ({files[n]['size']}; file "
                "truncated, changed or corrupt)"
            )
    for n in names:
        if sha256_file(base / n) != files[n]["sha256"]:
            raise ManifestError(
                f"{base / n}: sha256 does not match {manifest.name} (file changed or corrupt)"
            )


def verify_manifest(folder: Path, files: Iterable[str] | None = None) -> dict[str, Any] | None:
    """Check `folder` against its manifest.json; return the manifest, or None (with a warning) if it has none.

    `files`: only these names (what a loader is about to read); a name that exists but is not listed is
    refused, a name that neither exists nor is listed is skipped (the loader decides whether it needs it).
    Without `files`: every listed file, and no unlisted weight file.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        _warn_legacy(folder, folder)
        return None
    doc = read_manifest(path)
    listed = doc["files"]
    if files is None:
        names = sorted(listed)
        extra = [n for n in _listable(folder) if n not in listed and n.endswith(WEIGHT_SUFFIXES)]
    else:
        wanted = list(dict.fromkeys(files))
        extra = [n for n in wanted if n not in listed and (folder / n).exists()]
        names = [n for n in wanted if n in listed]
    if extra:
        raise ManifestError(
            f"{folder / extra[0]}: not listed in {MANIFEST} (added after the folder was written)"
        )
    _check(folder, path, doc, names)
    return doc


def verify_file(path: Path, warn: bool = True) -> dict[str, Any] | None:
    """Check one file (a GGUF) against its sidecar manifest; None (a warning unless `warn` is off) if none."""
    path = Path(path)
    side = sidecar(path)
    if not side.is_file():
        if warn:
            _warn_legacy(path, path)
        return None
    doc = read_manifest(side)
    if list(doc["files"]) != [path.name]:
        raise ManifestError(f"{side}: describes {sorted(doc['files'])}, not {path.name}")
    _check(path.parent, side, doc, [path.name])
    return doc


def verify_artifact(path: Path) -> dict[str, Any] | None:
    """A folder (its manifest.json), a manifest file itself, or a single file (its sidecar)."""
    path = Path(path)
    if path.is_dir():
        return verify_manifest(path)
    if path.name == MANIFEST:
        return verify_manifest(path.parent)
    if path.name.endswith(SIDECAR_SUFFIX):
        return verify_file(path.with_name(path.name[: -len(SIDECAR_SUFFIX)]))
    return verify_file(path)


def has_manifest(path: Path) -> bool:
    path = Path(path)
    return (path / MANIFEST).is_file() if path.is_dir() else sidecar(path).is_file()


def guess_kind(path: Path) -> str:
    """What an artifact without a manifest is, from the files it holds."""
    path = Path(path)
    if path.is_file():
        return "gguf" if path.suffix == ".gguf" else "file"
    for marker, kind in (
        ("adapter_config.json", "lora-adapter"),
        ("config.json", "hf-model"),
        ("tokenizer.model", "tokenizer"),
    ):
        if (path / marker).is_file():
            return kind
    return "folder"


def check_export_gguf(folder: Path) -> str | None:
    """The GGUF an export.json in `folder` records, checked against the sha256 recorded there."""
    info_path = Path(folder) / "export.json"
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{info_path}: unreadable ({e})") from None
    if not info.get("gguf") or not info.get("gguf_sha256"):
        return None
    gguf = Path(info["gguf"])
    if not gguf.is_file() and (Path(folder).parent / gguf.name).is_file():
        gguf = Path(folder).parent / gguf.name  # recorded relative to another working folder
    if not gguf.is_file():
        return f"gguf {gguf} (recorded in {info_path}): not found here, not checked"
    if sha256_file(gguf) != info["gguf_sha256"]:
        raise ManifestError(f"{gguf}: sha256 does not match {info_path} (file changed or corrupt)")
    return f"gguf {gguf}: sha256 matches {info_path}"

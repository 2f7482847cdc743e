"""Fetch each source into data/raw and verify it: pinned sha256 first, else the lock file's, else record one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..config.data import DebSource, HfSource, LocalSource, UrlSource
from ..errors import DataError
from ..io import canonical_json, sha256_file
from .download import download
from .util import log

Source = DebSource | UrlSource | HfSource | LocalSource


@dataclass
class Lock:
    """Checksums of sources that the config does not pin, recorded on first fetch and verified after."""

    path: Path | None
    entries: dict[str, dict[str, str]] = field(default_factory=dict)
    dirty: bool = False

    @classmethod
    def load(cls, path: Path | None) -> Lock:
        if path is None or not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not a valid lock file: {e}") from None
        return cls(path, {k: dict(v) for k, v in data.get("sources", {}).items()})

    def check(self, source: str, key: str, pinned: str | None, actual: str, where: str) -> None:
        expected = pinned or self.entries.get(source, {}).get(key)
        if expected is None:
            self.entries.setdefault(source, {})[key] = actual
            self.dirty = True
            log(f"fetch: {source}: recorded sha256 {actual} of {key} in {self.path}")
            return
        if expected != actual:
            origin = "the config" if pinned else str(self.path)
            raise DataError(
                f"{where}: checksum mismatch: expected sha256 {expected} (from {origin}), got {actual}"
            )

    def save(self) -> None:
        if self.dirty and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(canonical_json({"sources": self.entries}), encoding="utf-8")
            self.dirty = False


def _apt_download(package: str, version: str, workdir: Path) -> Path:
    """`apt-get download PKG=VERSION` into workdir; `apt-get update` once if the package list lacks it."""

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["apt-get", "download", "-q", f"{package}={version}"], cwd=workdir, capture_output=True, text=True
        )

    if shutil.which("apt-get") is None:
        raise DataError(f"deb source {package}: apt-get is not available on this machine")
    res = run()
    if res.returncode != 0 and (
        "Unable to locate" in res.stderr or "Can't find a source" in res.stderr or "not found" in res.stderr
    ):
        log(f"fetch: {package}={version} not in the package lists; running apt-get update")
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
        res = run()
    if res.returncode != 0:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit status {res.returncode}"
        raise DataError(f"deb source {package}={version}: apt-get download failed: {msg}")
    debs = sorted(workdir.glob("*.deb"))
    if len(debs) != 1:
        raise DataError(
            f"deb source {package}={version}: expected one .deb from apt-get download, got {len(debs)}"
        )
    return debs[0]


def unpack_deb(deb: Path, dest: Path) -> Path:
    """`dpkg-deb -x` into a temporary folder, renamed when complete: no install, no root needed."""
    if (dest / ".complete").exists():
        return dest
    if shutil.which("dpkg-deb") is None:
        raise DataError(f"{deb}: dpkg-deb is not available to unpack it")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    res = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True)
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{deb}: dpkg-deb -x failed: {res.stderr.strip()}")
    (tmp / ".complete").write_text("")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", name)


def fetch_deb(src: DebSource, raw: Path, lock: Lock) -> Path:
    folder = raw / "deb"
    folder.mkdir(parents=True, exist_ok=True)
    deb = folder / f"{_safe(src.package)}_{_safe(src.version)}.deb"
    if not deb.exists():
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            got = _apt_download(src.package, src.version, Path(tmp))
            os.replace(got, deb)
    actual = sha256_file(deb)
    try:
        lock.check(src.name, deb.name, src.sha256, actual, f"deb source {src.name} ({deb})")
    except DataError:
        deb.unlink()  # next fetch downloads it again instead of failing on the same bad copy
        raise
    return unpack_deb(deb, folder / deb.stem)


def fetch_url(src: UrlSource, raw: Path, lock: Lock) -> Path:
    name = src.filename or _safe(src.url.rstrip("/").rsplit("/", 1)[-1].split("?")[0]) or "download"
    dest = raw / "url" / _safe(src.name) / name
    expected = src.sha256 or lock.entries.get(src.name, {}).get(name)
    actual = download(src.url, dest, expected, src.timeout_s, src.retries)
    lock.check(src.name, name, src.sha256, actual, f"url source {src.name} ({src.url})")
    return dest.parent


def hf_url(src: HfSource, file: str) -> str:
    return f"{src.endpoint.rstrip('/')}/datasets/{src.repo}/resolve/{src.revision}/{file}"


def fetch_hf(src: HfSource, raw: Path, lock: Lock) -> Path:
    root = raw / "hf" / _safe(src.repo) / _safe(src.revision)
    for file in src.files:
        url = hf_url(src, file)
        expected = src.sha256.get(file) or lock.entries.get(src.name, {}).get(file)
        actual = download(url, root / file, expected, src.timeout_s, src.retries)
        lock.check(src.name, file, src.sha256.get(file), actual, f"hf source {src.name} ({url})")
    return root


def fetch_local(src: LocalSource) -> Path:
    p = Path(src.path)
    if not p.exists():
        raise DataError(f"local source {src.name}: {p} does not exist")
    return p


def fetch_source(src: Source, raw: Path, lock: Lock) -> Path:
    """Return the file or folder holding the source's raw material, fetched and verified."""
    if isinstance(src, DebSource):
        return fetch_deb(src, raw, lock)
    if isinstance(src, UrlSource):
        return fetch_url(src, raw, lock)
    if isinstance(src, HfSource):
        return fetch_hf(src, raw, lock)
    return fetch_local(src)

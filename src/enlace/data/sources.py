"""Fetch each source into data/raw and verify it: pinned sha256 first, else the lock file's, else record one.

The lock file (configs/data/<name>.lock.json) is trust on first use: what the first fetch saw (a .deb's
sha256; a Hugging Face revision's commit and each file's size and sha256) is recorded atomically, and later
fetches must see exactly that.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.data import DebSource, HfSource, LocalSource, UrlSource
from ..errors import DataError
from ..io import atomic_write_json, sha256_file
from .download import download
from .util import log

Source = DebSource | UrlSource | HfSource | LocalSource


@dataclass
class Lock:
    """Checksums of sources that the config does not pin, recorded on first fetch and verified after."""

    path: Path | None
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
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
            atomic_write_json(self.path, {"sources": self.entries})
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


COMMIT = re.compile(r"[0-9a-f]{40}")


def hf_endpoint(src: HfSource) -> str:
    return src.endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _hf_call(what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """A huggingface_hub call with its errors turned into one line naming what failed."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return fn(*args, **kw)
    except RevisionNotFoundError:
        raise DataError(f"{what}: revision not found") from None
    except RepositoryNotFoundError:
        raise DataError(f"{what}: repository not found (or private)") from None
    except HfHubHTTPError as e:
        raise DataError(f"{what}: {str(e).splitlines()[0]}") from None
    except OSError as e:  # connection refused, DNS, timeouts
        raise DataError(f"{what}: {type(e).__name__}: {e}") from None


def resolve_hf(src: HfSource, api: Any) -> dict[str, Any]:
    """Resolve the revision to a commit and select the files: the lock entry of a first fetch."""
    where = f"hf source {src.name} ({src.repo}@{src.revision})"
    info = _hf_call(where, api.dataset_info, src.repo, revision=src.revision)
    commit = info.sha
    if not commit or not COMMIT.fullmatch(commit):
        raise DataError(f"{where}: the endpoint returned no commit for the revision")
    tree = _hf_call(
        where,
        lambda: list(api.list_repo_tree(src.repo, revision=commit, repo_type="dataset", recursive=True)),
    )
    sizes = {
        f.path: f.size for f in tree if getattr(f, "size", None) is not None and not hasattr(f, "tree_id")
    }
    chosen = sorted(p for p in sizes if any(fnmatch.fnmatchcase(p, pat) for pat in src.files))
    if src.max_files is not None:
        chosen = chosen[: src.max_files]
    if not chosen:
        raise DataError(f"{where}: no file of commit {commit} matches {src.files}")
    return {
        "repo": src.repo,
        "revision": src.revision,
        "files_selected": list(src.files),
        "max_files": src.max_files,
        "commit": commit,
        "files": {p: {"size": sizes[p]} for p in chosen},
    }


def fetch_hf(src: HfSource, raw: Path, lock: Lock) -> Path:
    """Download the selected files at the locked commit with huggingface_hub and verify size and sha256.

    First fetch: `revision` (e.g. main) is resolved to a commit, and the commit, file list, sizes and
    sha256 go into the lock. Later fetches download that commit and refuse any difference.
    """
    # Long: one download protocol in order: resolve or check the locked commit, download, verify every file.
    from huggingface_hub import HfApi, hf_hub_download

    endpoint = hf_endpoint(src)
    api = HfApi(endpoint=endpoint)
    entry = lock.entries.get(src.name)
    same = entry is not None and all(
        entry.get(k) == v
        for k, v in (
            ("repo", src.repo),
            ("revision", src.revision),
            ("files_selected", list(src.files)),
            ("max_files", src.max_files),
        )
    )
    if not same:
        if entry is not None:
            log(f"fetch: {src.name}: the config's repo, revision or files changed; pinning again")
        entry = resolve_hf(src, api)
        log(
            f"fetch: {src.name}: {src.repo}@{src.revision} is commit {entry['commit']}; locking {len(entry['files'])} files"
        )
    assert entry is not None
    commit = entry["commit"]
    root = raw / "hf" / _safe(src.repo) / commit
    for path, meta in entry["files"].items():
        dest = root / path
        where = f"hf source {src.name} ({src.repo}@{commit[:12]}:{path})"
        if not dest.exists():
            _hf_call(
                where,
                hf_hub_download,
                src.repo,
                path,
                repo_type="dataset",
                revision=commit,
                local_dir=str(root),
                endpoint=endpoint,
                etag_timeout=src.timeout_s,
            )
        size, actual = dest.stat().st_size, sha256_file(dest)
        expected = src.sha256.get(path) or meta.get("sha256")
        if (
            meta.get("size") is not None
            and size != meta["size"]
            or expected is not None
            and actual != expected
        ):
            dest.unlink()
            origin = "the config" if src.sha256.get(path) else str(lock.path)
            raise DataError(
                f"{where}: upstream changed: expected {meta.get('size')} bytes with sha256 {expected} "
                f"(from {origin}), got {size} bytes with sha256 {actual}; if the change is wanted, delete "
                f"the entry {src.name!r} from {lock.path} and fetch again"
            )
        meta["sha256"] = actual
    if lock.entries.get(src.name) != entry:
        lock.entries[src.name] = entry
        lock.dirty = True
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

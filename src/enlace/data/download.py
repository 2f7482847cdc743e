"""Resumable HTTP(S) download: Range requests, retries with backoff, a timeout, checksum before rename."""

from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import DataError
from ..io import CHUNK, sha256_file
from .util import progress

# Statuses worth retrying: the server or a proxy had a bad moment. Others (404, 403) will not change.
RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


def _attempt(url: str, part: Path, timeout: float) -> bool:
    """One request, appending to `part`. Returns True when the file is complete."""
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"User-Agent": "enlace-fetch"})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            return True  # the .part already holds every byte; the checksum decides
        raise
    with resp:
        status = resp.status
        if status == 206:
            mode = "ab"
            total = (
                have + int(resp.headers.get("Content-Length", -1))
                if resp.headers.get("Content-Length")
                else None
            )
        else:  # 200: the server ignored the Range header, start over
            mode, have = "wb", 0
            cl = resp.headers.get("Content-Length")
            total = int(cl) if cl is not None else None
        with (
            open(part, mode) as f,
            progress(
                total=total,
                initial=have,
                unit="B",
                unit_scale=True,
                desc=f"fetch {Path(url).name[:40]}",
                leave=False,
            ) as bar,
        ):
            while True:
                chunk = resp.read(CHUNK)
                if not chunk:
                    break
                f.write(chunk)
                bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    size = part.stat().st_size
    if total is not None and size < total:
        raise ConnectionError(f"connection closed after {size} of {total} bytes")
    return True


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = 60.0, retries: int = 3) -> str:
    """Fetch `url` to `dest` and return its sha256.

    The bytes go to `dest.part`; an interrupted transfer resumes from there with a Range request. The file is
    renamed to `dest` only when its checksum matches `sha256` (when given), so a file under the final name is
    always complete.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        actual = sha256_file(dest)
        if sha256 is None or actual == sha256:
            return actual
        dest.unlink()  # a stale or corrupted copy: fetch it again
    part = dest.with_name(dest.name + ".part")
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(0.2 * 2**attempt, 5.0))
        try:
            _attempt(url, part, timeout)
            break
        except urllib.error.HTTPError as e:
            if e.code not in RETRYABLE:
                raise DataError(f"{url}: HTTP {e.code} {e.reason}") from None
            last = e
        except (
            urllib.error.URLError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
            OSError,
        ) as e:
            last = e
    else:
        raise DataError(f"{url}: download failed after {retries + 1} attempts: {last}")
    actual = sha256_file(part)
    if sha256 is not None and actual != sha256:
        part.unlink()
        raise DataError(f"{url}: checksum mismatch: expected sha256 {sha256}, got {actual}")
    os.replace(part, dest)
    return actual


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

"""A local HTTP server that answers the Hugging Face Hub endpoints huggingface_hub uses to fetch a dataset.

Revision resolution (/api/datasets/R/revision/REV), the file tree (/api/datasets/R/tree/REV) and file
downloads (/datasets/R/resolve/REV/PATH, HEAD and GET with Range). A test double: it lives in tests/.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager


class Hub:
    """Repos: name -> {"branches": {branch: commit}, "commits": {commit: {path: bytes}}}."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict]] = {}
        self.drop_after: dict[str, int] = {}  # path -> bytes sent before the connection is cut (once)
        self.hits: list[tuple[str, str, str | None]] = []
        self.url = ""

    def publish(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit holding `files`; `branch` points at it. Returns the commit sha."""
        r = self.repos.setdefault(repo, {"branches": {}, "commits": {}})
        blob = json.dumps(sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items())).encode()
        commit = hashlib.sha1(blob + str(len(r["commits"])).encode()).hexdigest()
        r["commits"][commit] = dict(files)
        r["branches"][branch] = commit
        return commit

    def commit_of(self, repo: str, rev: str) -> str | None:
        r = self.repos.get(repo)
        if r is None:
            return None
        if rev in r["commits"]:
            return rev
        return r["branches"].get(rev)


def _handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _json(self, obj: object, status: int = 200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _missing(self, what: str, code: str) -> None:
            body = json.dumps({"error": what}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", what)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
            hub.hits.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "datasets"]:
                return self._api(parts[2:])
            if parts[0] == "datasets" and "resolve" in parts:
                i = parts.index("resolve")
                return self._file("/".join(parts[1:i]), parts[i + 1], "/".join(parts[i + 2 :]))
            self._missing("not found", "EntryNotFound")

        def _api(self, parts: list[str]) -> None:
            for i, p in enumerate(parts):
                if p in ("revision", "tree"):
                    repo, kind, rev = "/".join(parts[:i]), p, urllib.parse.unquote(parts[i + 1])
                    sub = "/".join(parts[i + 2 :])
                    break
            else:
                return self._missing("bad api path", "EntryNotFound")
            if repo not in hub.repos:
                return self._missing("Repository not found", "RepoNotFound")
            commit = hub.commit_of(repo, rev)
            if commit is None:
                return self._missing(f"Invalid rev id: {rev}", "RevisionNotFound")
            files = hub.repos[repo]["commits"][commit]
            if kind == "revision":
                return self._json(
                    {"id": repo, "sha": commit, "siblings": [{"rfilename": p} for p in sorted(files)]}
                )
            entries = [
                {
                    "type": "file",
                    "path": p,
                    "size": len(b),
                    "oid": hashlib.sha1(b).hexdigest(),
                    "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 130},
                }
                for p, b in sorted(files.items())
                if not sub or p.startswith(sub + "/")
            ]
            self._json(entries)

        def _file(self, repo: str, rev: str, path: str) -> None:
            commit = hub.commit_of(repo, rev)
            body = hub.repos[repo]["commits"][commit].get(path) if commit else None
            if body is None:
                return self._missing("Entry not found", "EntryNotFound")
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and self.command == "GET":
                start = int(rng[6:].split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            chunk = body[start:]
            self.send_header("Content-Length", str(len(chunk)))
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if self.command == "HEAD":
                return
            cut = hub.drop_after.pop(path, None)
            if cut is not None:
                # Send part of the file, then cut the connection: the client must resume with a Range.
                self.wfile.write(chunk[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(chunk)

    return H


@contextmanager
def serve_hub() -> Iterator[Hub]:
    hub = Hub()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield hub
    finally:
        httpd.shutdown()
        httpd.server_close()

"""`enlace serve` under a schema-based fuzzer: schemathesis reads the server's own /openapi.json and sends
requests generated from it, both ones that fit the schema and ones built not to. None may get a 5xx, and
the server must be healthy afterwards.

A bounded number of requests, derandomized (the same ones each run, so `make test` is repeatable), against
a real server process serving a tiny random model with a budget of a few tokens per answer.
"""

from __future__ import annotations

import json

import pytest
from helpers import make_folder
from serve_helpers import Server

pytestmark = pytest.mark.slow  # about a minute on 2 cores: make test runs it, make test-fast does not

EXAMPLES = 60  # per generation mode: about 120 requests in all


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    folder = make_folder(root / "base", max_position_embeddings=256)
    s = Server(
        ["--model", str(folder), "--max-tokens", "4", "--queue", "8"], cwd=root, log=root / "server.log"
    )
    yield s
    s.stop()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_never_get_a_server_error(server, mode):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    assert {"/v1/chat/completions", "/v1/completions", "/health"} <= set(schema.raw_schema["paths"])
    seen: list[tuple[str, str, int]] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=schema.as_strategy(generation_mode=GenerationMode(mode)))
    def check(case) -> None:
        response = case.call(base_url=server.url, timeout=60)
        seen.append((case.method, case.path, response.status_code))
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r:.300} -> {response.text[:300]}"
        )
        if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
            assert set(json.loads(response.text)["error"]) == {"message", "type", "param", "code"}

    check()
    assert len(seen) >= EXAMPLES // 2 and any(path.startswith("/v1/") for _, path, _ in seen)
    if mode == "positive":  # some generated requests were answered: the fuzzer reached the generation too
        assert any(path.endswith("completions") and status == 200 for _, path, status in seen), seen
    health = server.health()
    assert health["status"] == "ok" and health["busy"] == 0 and health["failed"] == 0, health

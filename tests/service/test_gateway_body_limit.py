"""A body over the limit (issue 35, item 20): a client that sends its whole body before it
reads the answer (Python's `http.client`, `requests`, curl without `Expect`) reads the 413,
not a connection reset; the gateway reads and drops what it sends, up to a bound. A real
gateway process, no scheduler behind it (the body is refused before anything needs one)."""

from __future__ import annotations

import http.client
import json

import pytest
from test_gateway_binding import _start

from gateway.middleware import DRAIN_BYTES


@pytest.fixture(scope="module")
def gateway(model_factory, tmp_path_factory):
    process, port, _ = _start(
        model_factory(arch="llama"), tmp_path_factory.mktemp("body-limit"), "--max-body-bytes", str(4 * 1024 * 1024)
    )
    yield port
    process.stop()


def _post(port: int, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("size_mb", [5, 10, 30])
def test_a_body_over_the_limit_sent_whole_reads_413(gateway, size_mb):
    body = json.dumps({"prompt": "a" * (size_mb * 1024 * 1024)}).encode()
    status, answer = _post(gateway, body)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert "4194304 bytes" in answer["error"]["message"]


def test_the_drain_bound_is_well_past_the_limit():
    assert DRAIN_BYTES >= 32 * 1024 * 1024

"""docker-compose.yml, checked offline: no Docker engine runs where the tests do.

The file is validated against the Compose Specification's JSON schema (the copy that
`check-jsonschema`, installed by `make install`, carries: `--builtin-schema
vendor.compose-spec`), and where `docker-compose` is installed also by `docker-compose config`.
The services are read as Compose resolves them: YAML anchors and merge keys, then `${VAR}`
interpolation with the file's defaults (`resolve`, checked against `docker-compose config`
where it is installed). Each service's command must then be one that `pagoda` accepts, and
the services must agree with one another: addresses name services and their ports, one KV
layout everywhere, health probes on the right ports.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wiring.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
PAGODA_SERVICES = ("kvcache", "worker-0", "worker-1", "scheduler", "gateway")
BACKEND = ("kvcache", "worker-0", "worker-1", "scheduler")
MODEL_MOUNT = "/models/tiny"


DOCKER_COMPOSE = shutil.which("docker-compose")
needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is not installed (the schema check runs without it)"
)


def _environment() -> dict[str, str]:
    """The file's defaults, not whatever this shell exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env["PAGODA_INTERNAL_TOKEN"] = "compose-test-secret"  # required: the operator sets one
    return env


def _docker_compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DOCKER_COMPOSE, "-f", str(COMPOSE_FILE), *args],
        cwd=REPO_ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _check_schema(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution in one string: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`
    (unset or empty), `${VAR-default}` (unset), `${VAR:?error}` and `${VAR?error}`."""

    def one(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        body = match["braced"]
        name, op, arg = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])(.*))?", body, re.S).groups()
        value = env.get(name)
        missing = value is None or (op is not None and op.startswith(":") and value == "")
        if op and op.endswith("-"):
            return interpolate(arg, env) if missing else value
        if op and op.endswith("?") and missing:
            raise ValueError(f"{name}: {arg or 'required'}")
        return value or ""

    return _VARIABLE.sub(one, value)


def resolve(document: Any, env: dict[str, str]) -> Any:
    """A loaded compose file (anchors and merge keys already applied by the YAML loader) with
    every string value interpolated, as Compose reads it."""
    if isinstance(document, dict):
        return {key: resolve(value, env) for key, value in document.items()}
    if isinstance(document, list):
        return [resolve(value, env) for value in document]
    return interpolate(document, env) if isinstance(document, str) else document


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The services as Compose resolves them."""
    return resolve(yaml.safe_load(COMPOSE_FILE.read_text()), _environment())["services"]


def parse(
    service: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> argparse.Namespace:
    """The service's command as `pagoda` parses it, under the service's environment (the
    flags' PAGODA_* defaults are read when the parser is built)."""
    for name in [k for k in os.environ if k.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    for name, value in (service.get("environment") or {}).items():
        monkeypatch.setenv(name, str(value))
    command = [str(arg) for arg in service["command"]]
    try:
        return build_parser().parse_args(command)
    except SystemExit:
        pytest.fail(f"pagoda does not accept {command}: {capsys.readouterr().err.strip()}")


def probe_code(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return test[3]


def probe_address(service: dict[str, Any]) -> str:
    match = re.search(r"check_health\('([^']+)'", probe_code(service))
    assert match, probe_code(service)
    return match.group(1)


# ---------------------------------------------------------------------------------------------


def test_the_file_follows_the_compose_specification(tmp_path) -> None:
    done = _check_schema(COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr
    # the check can fail: an unknown key, a port of the wrong type
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  a:\n    image: x\n    bogus: 1\n  b:\n    image: y\n    ports: {a: 1}\n")
    done = _check_schema(bad)
    assert done.returncode == 1 and "bogus" in done.stdout and "$.services.b.ports" in done.stdout, done.stdout


def test_interpolation_follows_compose() -> None:
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET}": "v",
        "$SET/x": "v/x",
        "${UNSET:-d}": "d",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${UNSET-d}": "d",
        "$$SET": "$SET",
        "a${UNSET}b": "ab",
        "${SET:?no}": "v",
        "${UNSET:-a b}": "a b",
    }
    for text, want in cases.items():
        assert interpolate(text, env) == want, text
    with pytest.raises(ValueError, match="UNSET: no"):
        interpolate("${UNSET:?no}", env)


@needs_docker_compose
def test_docker_compose_reads_the_file_as_resolved_here(services) -> None:
    done = _docker_compose("config")
    assert done.returncode == 0, done.stderr
    theirs = yaml.safe_load(done.stdout)["services"]
    assert set(theirs) == set(services)
    for name, service in services.items():
        assert [str(a) for a in theirs[name]["command"]] == [str(a) for a in service["command"]], name
        env = {k: "" if v is None else str(v) for k, v in (theirs[name].get("environment") or {}).items()}
        assert env == {k: str(v) for k, v in (service.get("environment") or {}).items()}, name
        assert theirs[name].get("healthcheck", {}).get("test") == service.get("healthcheck", {}).get("test")


def test_the_stack_has_every_service(services) -> None:
    assert set(services) == {*PAGODA_SERVICES, "redis", "prometheus"}
    for name in PAGODA_SERVICES:
        service = services[name]
        assert service["image"] == services["gateway"]["image"], name  # one image, built once
        # the model directory, mounted read-only
        assert any(str(v).endswith(f":{MODEL_MOUNT}:ro") for v in service["volumes"]), name
        assert "healthcheck" in service, name


@pytest.mark.parametrize("name", PAGODA_SERVICES)
def test_each_command_is_one_pagoda_accepts(name, services, monkeypatch, capsys) -> None:
    args = parse(services[name], monkeypatch, capsys)
    assert args.command == services[name]["command"][0]
    assert args.host == "0.0.0.0"  # reachable by the other containers


def test_the_backend_services_agree(services, monkeypatch, capsys) -> None:
    args = {name: parse(services[name], monkeypatch, capsys) for name in BACKEND}
    kv, w0, w1, sched = (args[n] for n in BACKEND)
    # addresses are service names and the ports those services bind
    assert sched.kvcache == f"kvcache:{kv.port}"
    assert sched.stages == f"worker-0:{w0.port},worker-1:{w1.port}"
    assert w0.next == f"worker-1:{w1.port}" and w1.next is None
    assert (w0.stage, w1.stage, w0.num_stages, w1.num_stages) == (0, 1, 2, 2)
    assert sched.pipeline_parallel_size == 2
    # one KV layout for the KV service, every worker and the scheduler
    assert kv.num_blocks == w0.num_kv_blocks == w1.num_kv_blocks == sched.num_kv_blocks
    assert kv.block_size == w0.block_size == w1.block_size == sched.block_size
    assert w0.model == w1.model == sched.model == MODEL_MOUNT


def test_the_gateway_is_the_only_published_service(services, monkeypatch, capsys) -> None:
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"gateway", "prometheus"}  # (Prometheus' UI, on the host's loopback)
    for name in published:
        for port in services[name]["ports"]:
            host = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host == "127.0.0.1", (name, port)
    gateway = parse(services["gateway"], monkeypatch, capsys)
    scheduler = parse(services["scheduler"], monkeypatch, capsys)
    assert gateway.scheduler == f"scheduler:{scheduler.port}"
    assert gateway.model == MODEL_MOUNT
    targets = {
        str(p["target"]) if isinstance(p, dict) else str(p).split(":")[-1].split("/")[0]
        for p in services["gateway"]["ports"]
    }
    assert targets == {str(gateway.port), str(gateway.grpc_port)}


def test_dependencies_wait_for_health(services) -> None:
    want = {"worker-0": {"worker-1"}, "scheduler": {"kvcache", "worker-0", "worker-1"}, "gateway": {"scheduler"}}
    for name, deps in want.items():
        depends_on = services[name]["depends_on"]
        assert set(depends_on) == deps, name
        assert all(d["condition"] == "service_healthy" for d in depends_on.values()), name


def test_health_probes_target_each_service_port(services, monkeypatch, capsys) -> None:
    for name in BACKEND:
        port = parse(services[name], monkeypatch, capsys).port
        assert probe_address(services[name]) == f"127.0.0.1:{port}", name
    # the gateway's gRPC port answers grpc.health.v1 (as `pagoda serve` checks it)
    assert probe_address(services["gateway"]).endswith(":50051")
    assert "50051" in [str(a) for a in services["gateway"]["command"]]


def test_the_health_probe_works(services) -> None:
    """The probe exits 0 against a SERVING gRPC health service and 1 when nothing listens."""
    code = probe_code(services["kvcache"])
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = probe_address(services["kvcache"])
        serving = subprocess.run(
            [sys.executable, "-c", code.replace(address, f"127.0.0.1:{port}")], cwd=REPO_ROOT, timeout=60
        )
    finally:
        server.stop(None)
    down = subprocess.run(
        [sys.executable, "-c", code.replace(address, f"127.0.0.1:{port}")],
        cwd=REPO_ROOT,
        timeout=60,
        capture_output=True,
    )
    assert (serving.returncode, down.returncode) == (0, 1)


def test_every_pagoda_service_shares_the_internal_secret(services) -> None:
    """Service-to-service authentication (docs/architecture.md): every Pagoda service gets
    the stack's secret, and the file refuses to resolve without one."""
    pagoda = [name for name, s in services.items() if s.get("image") == "pagoda:local"]
    assert len(pagoda) >= 5
    for name in pagoda:
        assert services[name]["environment"]["PAGODA_INTERNAL_TOKEN"] == "compose-test-secret", name
    env = {k: v for k, v in _environment().items() if k != "PAGODA_INTERNAL_TOKEN"}
    with pytest.raises(ValueError, match="PAGODA_INTERNAL_TOKEN"):
        resolve(yaml.safe_load(COMPOSE_FILE.read_text()), env)

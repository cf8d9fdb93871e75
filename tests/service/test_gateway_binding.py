"""Where the gateway listens (issue 16, defect 11): with `--host 0.0.0.0` (or `::`) both front
doors take IPv4 and IPv6 alike; by default both are on loopback only. A real gateway process,
no scheduler behind it (REST /version and the gRPC port answer without one)."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from gateway.server import REST_SEND_BUFFER, grpc_address, rest_socket
from wiring.launcher import ServiceProcess, free_port, pagoda_command


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _connects(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def _start(model_dir, tmp_path, *host_args):
    port, grpc_port = free_port(), free_port()
    gateway = ServiceProcess(
        "gateway",
        pagoda_command(
            "gateway",
            "--model",
            model_dir,
            "--scheduler",
            f"127.0.0.1:{free_port()}",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            *host_args,
        ),
        f"127.0.0.1:{grpc_port}",
        log_path=tmp_path / "gateway.log",
    )
    gateway.start()
    deadline = time.time() + 60
    while time.time() < deadline and gateway.process.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=2)
            return gateway, port, grpc_port
        except OSError:
            time.sleep(0.2)
    gateway.stop()
    raise AssertionError((tmp_path / "gateway.log").read_text()[-2000:])


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(arch="llama")


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this machine")
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_all_interfaces_means_ipv4_and_ipv6_on_both_front_doors(model_dir, tmp_path, host):
    # beyond loopback the gateway insists on API keys (/version stays open)
    gateway, port, grpc_port = _start(model_dir, tmp_path, "--host", host, "--api-key", "sk-binding-test")
    try:
        for address in ("127.0.0.1", "::1"):
            assert _connects(address, port), f"REST on {address}"
            assert _connects(address, grpc_port), f"gRPC on {address}"
        assert urllib.request.urlopen(f"http://[::1]:{port}/version", timeout=5).status == 200
    finally:
        gateway.stop()


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this machine")
def test_the_default_is_ipv4_loopback_on_both(model_dir, tmp_path):
    gateway, port, grpc_port = _start(model_dir, tmp_path)
    try:
        assert _connects("127.0.0.1", port) and _connects("127.0.0.1", grpc_port)
        assert not _connects("::1", port) and not _connects("::1", grpc_port)
    finally:
        gateway.stop()


def test_grpc_addresses():
    assert grpc_address("0.0.0.0", 5) == grpc_address("::", 5) == "[::]:5"
    assert grpc_address("::1", 5) == "[::1]:5" and grpc_address("127.0.0.1", 5) == "127.0.0.1:5"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_rest_connections_have_a_bounded_kernel_send_buffer(host):
    """A client that stops reading can hold at most this much in the kernel (slow consumers,
    issue 16): accepted connections inherit the listener's capped SO_SNDBUF, where
    autotuning would let them grow to tcp_wmem's maximum."""
    listener = rest_socket(host, 0)
    try:
        listener.setblocking(True)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = listener.accept()
            with conn:
                size = conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert 0 < size <= 2 * REST_SEND_BUFFER  # (Linux doubles what is set, for its bookkeeping)
    finally:
        listener.close()


def test_a_taken_rest_port_is_refused():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(OSError):
            rest_socket("127.0.0.1", holder.getsockname()[1])

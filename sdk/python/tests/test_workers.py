"""Workers found as the CLI finds them: a list and a DNS name, with new
sandboxes placed on the freer worker and old ones found where they are; TLS
and mutual TLS with the options the CLI takes."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Worker, free_port

import corral
from corral import _connect


def test_a_list_places_on_the_freer_worker_and_finds_sandboxes_where_they_are(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    a = own_worker("--max-sandboxes", "1")
    b = own_worker("--max-sandboxes", "4")
    # One token for both, as a fleet has.
    b.token_file.write_bytes(a.token_file.read_bytes())
    b.stop()
    b.start()
    both = f"{a.url},{b.url}"
    token = str(a.token_file)
    with corral.Sandbox.create(worker=a.url, token_file=token) as first:
        assert first.worker == a.url
        # a is full: every new one goes to b, whatever the order.
        made = [corral.Sandbox.create(worker=both, token_file=token) for _ in range(3)]
        assert {s.worker for s in made} == {b.url}
        found = corral.Sandbox.connect(first.id, both, token_file=token)
        assert found.worker == a.url
        assert found.run("echo here").stdout == "here\n"
        ids = {s.id for s in corral.list_sandboxes(both, token_file=token)}
        assert ids == {first.id, *(s.id for s in made)}
        for s in made:
            s.remove()
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox.connect("nowhere", both, token_file=token)


def test_a_list_with_a_worker_down_lists_the_others_and_names_it(
    own_worker: Callable[..., Worker],
) -> None:
    a = own_worker()
    b = own_worker()
    down = b.url
    b.stop()
    token = str(a.token_file)
    with corral.Sandbox.create(worker=a.url, token_file=token) as sb:
        listed = corral.list_sandboxes(f"{a.url},{down}", token_file=token)
        assert [s.id for s in listed] == [sb.id]
        assert list(listed.unreachable) == [down]
        assert isinstance(listed.unreachable[down], corral.WorkerUnavailable)
        assert corral.list_sandboxes(a.url, token_file=token).unreachable == {}
    # The one worker named: its failure is the call's.
    with pytest.raises(corral.WorkerUnavailable):
        corral.list_sandboxes(down, token_file=token)


def test_a_dns_name_is_a_worker_per_address(own_worker: Callable[..., Worker]) -> None:
    w = own_worker()
    with corral.Sandbox.create(
        worker=f"dns:///localhost:{w.port}", token_file=str(w.token_file)
    ) as sb:
        assert sb.run("echo via dns").stdout == "via dns\n"
        assert sb.worker in (f"http://127.0.0.1:{w.port}", f"http://[::1]:{w.port}")


def pki(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=corral-test-ca",
    )
    for name, ext in [
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (d / f"{name}.ext").write_text(ext + "\n")
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    for f in d.glob("*.key"):
        f.chmod(0o600)
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_mutual_tls(
    own_worker: Callable[..., Worker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = pki(tmp_path)
    w = own_worker(
        "--tls-cert",
        str(p["server.pem"]),
        "--tls-key",
        str(p["server.key"]),
        "--tls-client-ca",
        str(p["ca.pem"]),
    )
    url = f"https://127.0.0.1:{w.port}"
    tls: dict[str, Any] = {"tls_ca": str(p["ca.pem"]), "token_file": str(w.token_file)}
    with corral.Sandbox.create(
        worker=url, tls_cert=str(p["client.pem"]), tls_key=str(p["client.key"]), **tls
    ) as sb:
        assert sb.run("echo over tls").stdout == "over tls\n"
    # No client certificate: refused by the worker.
    from corral import _core

    monkeypatch.setattr(_core, "PATIENCE_S", 1.0)
    with pytest.raises(corral.CorralError):
        corral.Sandbox.create(worker=url, **tls)
    with pytest.raises(corral.ConfigError):
        corral.Sandbox.create(worker=url, tls_cert=str(p["client.pem"]), **tls)


def test_the_kernel_and_proc_name_the_same_listeners() -> None:
    """Who listens on a local port (a token goes only to a worker whose socket
    is this user's): asked of the kernel over netlink, as /proc/net/tcp says."""
    with socket.socket() as v4, socket.socket() as other:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        port = v4.getsockname()[1]
        # A connection to it is not a listener; another port is left out.
        with socket.create_connection(("127.0.0.1", port)):
            other.bind(("127.0.0.1", 0))
            other.listen()
            found = _connect._diag_listeners(port)
            assert found == [(ipaddress.IPv4Address("127.0.0.1"), os.geteuid())]
            assert _connect._proc_listeners(port) == found
            assert _connect.listener_owners("localhost", port) == [os.geteuid()]
            assert _connect.listener_owners("127.0.0.2", port) == []
        free = other.getsockname()[1]
    assert _connect._diag_listeners(free) == []
    assert _connect._proc_listeners(free) == []


def test_without_netlink_listeners_are_read_from_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A system without netlink (not Linux, or refused) falls back to /proc,
    never fails the call."""
    monkeypatch.delattr(socket, "AF_NETLINK")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError):
            _connect._diag_listeners(port)
        assert _connect.listener_owners("127.0.0.1", port) == [os.geteuid()]


SQUATTER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(16)
print("listening", flush=True)
s.settimeout(30)
while True:
    try:
        c, _ = s.accept()
    except OSError:
        break
    c.settimeout(2)
    try:
        while True:
            d = c.recv(65536)
            if not d:
                break
            sys.stdout.buffer.write(d); sys.stdout.flush()
    except OSError:
        pass
"""


def squat(port: int) -> subprocess.Popen[bytes]:
    """A listener of the user nobody on ``port``, listening when returned
    (Debian's python: a toolchain under root's home is not nobody's)."""
    squatter = subprocess.Popen(
        ["/usr/bin/python3", "-c", SQUATTER, str(port)],
        user=65534,
        group=65534,
        cwd="/",
        stdout=subprocess.PIPE,
    )
    assert squatter.stdout is not None
    assert squatter.stdout.readline() == b"listening\n"
    return squatter


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a listener as the user nobody")
def test_a_squatter_on_a_restarted_workers_port_gets_no_token(
    own_worker: Callable[..., Worker],
) -> None:
    """The worker stops and another local user takes its port: the SDK's
    next call (a reconnect) sends that user nothing."""
    w = own_worker()
    token = w.token_file.read_text().strip()
    with corral.Sandbox.create(worker=w.url, token_file=str(w.token_file)) as sb:
        assert sb.run("true").ok
        w.stop()
        squatter = squat(w.port)
        try:
            with pytest.raises(corral.ConfigError, match="belongs to uid 65534"):
                sb.run("true")
        finally:
            squatter.kill()
            got, _ = squatter.communicate()
        assert token.encode() not in got, "the squatter got the token"
        w.start()
        assert sb.run("echo back").stdout == "back\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a listener as the user nobody")
def test_a_connection_made_to_another_users_socket_is_found_before_a_token_goes() -> None:
    """The check of the connection itself, after it is made (a listener
    taken between the check of the port and the connect)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    squatter = squat(port)
    try:
        with (
            socket.create_connection(("127.0.0.1", port)),
            pytest.raises(corral.ConfigError, match="socket of uid 65534"),
        ):
            _connect.check_connected(url, None)
    finally:
        squatter.kill()
        squatter.wait()
    # Our own listener's connection passes.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        own = f"http://127.0.0.1:{s.getsockname()[1]}"
        with socket.create_connection(s.getsockname()):
            conn, _ = s.accept()
            with conn:
                _connect.check_connected(own, None)

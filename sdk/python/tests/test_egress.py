"""Egress by policy from Python: a sandbox made with ``egress`` reaches what
it names through its worker's proxy, and nothing else; its policy is
replaced at run time; a worker's bound is a typed refusal naming its flag.
The upstream is an HTTP server of the test's own on 127.0.0.2."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator

import pytest
from conftest import Worker

import corral


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello through the worker"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Hello)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _status(sb: corral.Sandbox, url: str) -> str:
    return sb.run(f"curl -s -o /dev/null -w '%{{http_code}}' {url}").stdout


def test_a_sandbox_reaches_what_it_names_and_its_policy_changes_live(
    own_worker: Callable[..., Worker], upstream: int
) -> None:
    w = own_worker(
        "--allow-image",
        "corral-debian:latest",
        "--allow-egress",
        "*",
        # The test's upstream is on loopback, as a package mirror on an
        # internal network would be: exempted by the operator.
        "--egress-allow-internal",
        "127.0.0.2/32",
    )
    rule = f"127.0.0.2/32:{upstream}"
    with w.create(image="corral-debian:latest", egress=[rule]) as sb:
        assert sb.info().egress == (rule,)
        r = sb.run(f"curl -sS http://127.0.0.2:{upstream}/")
        assert r.ok and r.stdout == "hello through the worker", r
        # The proxy says why it refuses, in a header.
        r = sb.run(f"curl -sS -D - -o /dev/null http://127.0.0.2:{upstream + 1}/ || true")
        assert "X-Corral-Egress: blocked; reason=port" in r.stdout, r
        # Replaced: nothing allowed now, at once (the proxy stays).
        emptied = sb.set_egress([])
        assert emptied.egress == () and emptied.egress_proxy
        assert _status(sb, f"http://127.0.0.2:{upstream}/") == "403"
        assert sb.set_egress([rule]).egress == (rule,)
        assert _status(sb, f"http://127.0.0.2:{upstream}/") == "200"
    # egress=[]: the proxy, nothing allowed until a policy is given.
    with w.create(image="corral-debian:latest", egress=[]) as sb:
        assert sb.info().egress == () and sb.info().egress_proxy
        assert _status(sb, f"http://127.0.0.2:{upstream}/") == "403"
        sb.set_egress([rule])
        assert _status(sb, f"http://127.0.0.2:{upstream}/") == "200"


def test_what_the_worker_does_not_allow_is_a_policy_refusal(
    own_worker: Callable[..., Worker],
) -> None:
    w = own_worker("--allow-egress", "pypi.org")
    with pytest.raises(corral.PolicyDenied) as e:
        w.create(egress=["github.com"])
    assert e.value.flag == "--allow-egress"
    with pytest.raises(corral.InvalidArgument):
        w.create(egress=["not a rule"])
    # A sandbox made without egress has no proxy to change.
    with w.create() as sb:
        assert not sb.info().egress_proxy
        with pytest.raises(corral.InvalidArgument):
            sb.set_egress(["pypi.org"])
    # A worker that gives no egress refuses even an empty proxy.
    with pytest.raises(corral.PolicyDenied) as e:
        own_worker().create(egress=[])
    assert e.value.flag == "--allow-egress"

"""A sandbox's port reached from outside: exposed by the SDK, opened with
Python's own HTTP client, with the token as a bearer and in the URL."""

from __future__ import annotations

import http.cookiejar
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from conftest import Worker, free_port

import corral


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_server_in_a_sandbox_is_reached_through_its_exposed_port(
    own_worker: Callable[..., Worker],
) -> None:
    w = own_worker(
        "--ports-listen",
        f"127.0.0.1:{free_port()}",
        "--allow-image",
        "corral-debian:latest",
    )
    with w.create(image="corral-debian:latest") as sb:
        sb.files.write("index.html", "<h1>from the sandbox</h1>")
        server = sb.start("exec python3 -m http.server 8000 --bind 127.0.0.1")
        sb.wait_for_port(8000, timeout=30)
        e = sb.ports.expose(8000, access="signed", ttl=600)
        assert e.access is corral.PortAccess.SIGNED
        assert e.token and e.url.endswith(f"/p/{sb.id}/8000/")
        assert e.expires_at is not None
        # A program: the token as a bearer.
        status, body = _get(e.url, {"Authorization": f"Bearer {e.token}"})
        assert (status, "from the sandbox" in body) == (200, True), body
        # No token: refused, with a reason a program reads.
        status, body = _get(e.url)
        assert status == 401 and '"unauthenticated"' in body, body
        # The URL as it is: served. Routed by path (this worker has no
        # domain), every sandbox shares the origin, so no cookie is left.
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with opener.open(e.browser_url, timeout=30) as r:
            assert r.status == 200
            assert "from the sandbox" in r.read().decode()
        assert list(jar) == []
        # Listed without its token; revoked, refused as such.
        [listed] = sb.ports.list()
        assert (listed.port, listed.token, listed.wake_on_request) == (8000, None, False)
        waking = sb.ports.expose(8001, wake_on_request=True)
        assert waking.wake_on_request
        assert [p.wake_on_request for p in sb.ports.list()] == [False, True]
        assert sb.ports.revoke(8001)
        assert sb.get_host(8000) == e.url
        assert sb.ports.revoke(8000)
        status, body = _get(e.url, {"Authorization": f"Bearer {e.token}"})
        assert status == 401 and '"revoked"' in body, body
        assert not sb.ports.revoke(8000)
        with pytest.raises(corral.InvalidArgument):
            sb.ports.expose(0)
        with pytest.raises(corral.PolicyDenied):
            sb.ports.expose(8000, access="public")
        server.kill()

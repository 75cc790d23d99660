"""The HTTP/JSON gateway, on the worker's own address: every call of
``corral.v1.Worker`` made with curl (``http/every_call.sh``, which checks
what each answers), the OpenAPI document at ``/openapi.json`` valid
(``openapi-spec-validator``) and every answer the script kept held to the
schema the document gives for its path, method and status (``jsonschema``,
no field it does not describe). Through a front door: a tenant's key as a
Bearer, another tenant's sandbox not found, an auditor's key refused what
it may not do, sessions listed."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import FrontDoor, Worker, free_port
from openapi_spec_validator import validate

SCRIPT = Path(__file__).parent / "http" / "every_call.sh"


def fetch(
    url: str,
    token: str | None,
    method: str = "GET",
    body: Any = None,
) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get_content_type(), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get_content_type(), e.read()


def held_to(doc: dict[str, Any], schema: dict[str, Any], instance: Any, what: str) -> None:
    root = {**schema, "components": doc["components"]}
    errors = list(jsonschema.Draft202012Validator(root).iter_errors(instance))
    assert not errors, f"{what}: {errors[0].message} at {list(errors[0].absolute_path)}"


def check_answer(doc: dict[str, Any], out: Path, name: str) -> None:
    """The answer kept as ``name`` against the document's schema for it."""
    method, template = (out / f"{name}.request").read_text().split()
    status = (out / f"{name}.status").read_text().strip()
    ctype = (out / f"{name}.type").read_text().strip()
    body = (out / f"{name}.body").read_bytes()
    op = doc["paths"][template][method.lower()]
    answer = op["responses"].get(status) or op["responses"]["default"]
    assert ctype in answer["content"], (name, ctype, list(answer["content"]))
    schema = answer["content"][ctype]["schema"]
    error = doc["components"]["schemas"]["corral.Error"]
    if ctype == "application/json":
        held_to(doc, schema, json.loads(body), name)
    elif ctype == "application/x-ndjson":
        lines = [json.loads(x) for x in body.splitlines() if x.strip()]
        assert lines, name
        for line in lines:
            held_to(doc, error if "error" in line else schema, line, name)
    elif ctype == "text/event-stream":
        item = doc["paths"][template][method.lower()]["responses"]["200"]["content"][
            "application/x-ndjson"
        ]["schema"]
        events = [x.removeprefix(b"data: ") for x in body.splitlines() if x.startswith(b"data: ")]
        assert events, name
        for e in events:
            held_to(doc, item, json.loads(e), name)
    else:
        assert ctype == "application/x-tar", (name, ctype)


def test_every_worker_call_through_curl_matches_the_openapi_document(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker("--allow-build", "--ports-listen", f"127.0.0.1:{free_port()}")
    out = tmp_path / "answers"
    run = subprocess.run(
        ["bash", str(SCRIPT), w.url, str(w.token_file), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    status, ctype, raw = fetch(f"{w.url}/openapi.json", w.token_file.read_text().strip())
    assert (status, ctype) == (200, "application/json")
    doc = json.loads(raw)
    validate(doc)
    # No token: the document is the API's, not for anyone.
    assert fetch(f"{w.url}/openapi.json", None)[0] == 401
    # Every answer held to its schema; every method of the service called.
    called = set()
    for req in out.glob("*.request"):
        name = req.name.removesuffix(".request")
        m, template = req.read_text().split()
        called.add(doc["paths"][template][m.lower()]["operationId"].rsplit(".", 1)[-1])
        check_answer(doc, out, name)
    methods = {p.rsplit("/", 1)[-1] for p in doc["paths"] if p.startswith("/v1/corral.v1.Worker/")}
    assert len(methods) >= 33, methods
    assert methods - called == set(), f"never called: {sorted(methods - called)}"


def test_a_front_door_answers_http_as_its_tenants_keys_allow(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker()
    (tmp_path / "door").mkdir()
    door = FrontDoor(tmp_path / "door", w)
    try:
        url = door.url
        status, _, raw = fetch(f"{url}/v1/sandboxes", door.acme, "POST", {"spec": {}})
        assert status == 200, raw
        mine = json.loads(raw)["id"]
        # Another tenant: as if it did not exist.
        status, _, raw = fetch(f"{url}/v1/sandboxes/{mine}", door.bolt)
        assert status == 404 and json.loads(raw)["error"]["reason"] == "sandbox_not_found", raw
        status, _, raw = fetch(f"{url}/v1/sandboxes", door.bolt)
        assert status == 200 and mine not in raw.decode(), raw
        # An auditor reads, never runs.
        auditor = door.auditor
        status, _, raw = fetch(f"{url}/v1/sandboxes/{mine}", auditor)
        assert status == 200, raw
        status, _, raw = fetch(
            f"{url}/v1/sandboxes/{mine}/run",
            auditor,
            "POST",
            {"spec": {"shell": {"command": "true"}}},
        )
        assert status == 403, raw
        # Sessions, through the generic path of corral.v1.Control and their
        # resource paths.
        status, _, raw = fetch(f"{url}/v1/corral.v1.Control/ListSessions", door.acme, "POST", {})
        assert status == 200, raw
        status, _, raw = fetch(f"{url}/v1/sessions", door.acme)
        assert status == 200 and json.loads(raw).get("sessions", []) == [], raw
        for method, path in [
            ("DELETE", "/v1/sessions/acme.nobody"),
            ("GET", "/v1/sessions/acme.nobody/events"),
            ("POST", "/v1/sessions/acme.nobody/stop"),
        ]:
            status, _, raw = fetch(f"{url}{path}", door.acme, method)
            assert status == 404, (path, raw)
            assert json.loads(raw)["error"]["reason"] == "session_not_found", (path, raw)
        # Keys and quotas: for an admin key alone.
        status, _, raw = fetch(f"{url}/v1/admin/keys", door.acme)
        assert status == 403, raw
        admin = door.key("acme", "admin")
        deadline = time.monotonic() + 10  # a key made now is taken within a second
        while True:
            status, _, raw = fetch(
                f"{url}/v1/admin/keys",
                admin,
                "POST",
                {"tenant": "bolt", "scopes": ["KEY_SCOPE_READ"], "ttl_ms": "60000"},
            )
            if status != 401 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200, raw
        made = json.loads(raw)
        assert made["key"], made
        status, _, raw = fetch(f"{url}/v1/admin/keys", admin)
        assert status == 200 and made["key"] not in raw.decode(), raw
        ids = [k["id"] for k in json.loads(raw)["keys"] if k["tenant"] == "bolt"]
        assert made["info"]["id"] in ids and len(ids) == 2, raw
        status, _, raw = fetch(
            f"{url}/v1/admin/quotas/bolt", admin, "PUT", {"quotas": ["sandboxes=3"]}
        )
        assert status == 200, raw
        status, _, raw = fetch(f"{url}/v1/admin/quotas", admin)
        assert status == 200 and "bolt" in raw.decode(), raw
        status, _, raw = fetch(f"{url}/v1/admin/keys/{made['info']['id']}", admin, "DELETE")
        assert status == 200, raw
        status, _, raw = fetch(f"{url}/v1/sandboxes", "not-a-key")
        assert status == 401, raw
        status, _, raw = fetch(f"{url}/v1/sandboxes/{mine}", door.acme, "DELETE")
        assert status == 200 and json.loads(raw)["existed"] is True, raw
    finally:
        door.stop()


@pytest.mark.parametrize(
    "body",
    [b"{", b'{"spec": {"memory_bytes": "lots"}}', b"[1]", b"\x00\xff"],
)
def test_a_malformed_body_is_a_clear_400(own_worker: Callable[..., Worker], body: bytes) -> None:
    w = own_worker()
    req = urllib.request.Request(f"{w.url}/v1/sandboxes", data=body, method="POST")
    req.add_header("Authorization", f"Bearer {w.token_file.read_text().strip()}")
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("taken")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        err = json.loads(e.read())["error"]
        assert err["code"] == "INVALID_ARGUMENT" and "JSON" in err["message"], err
    assert w.list() == []


def test_the_gateway_checks_before_it_reads_and_answers_every_path(
    own_worker: Callable[..., Worker],
) -> None:
    w = own_worker("--allow-build")
    token = w.token_file.read_text().strip()
    # No token: refused before a byte of a large body is read or parsed.
    junk = b'{"spec": {"volumes": [' + b"{}," * (4 << 20) + b"{}]}}"
    req = urllib.request.Request(f"{w.url}/v1/sandboxes", data=junk, method="POST")
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("taken")
    except urllib.error.HTTPError as e:
        assert e.code == 401, e.read()
    except (ConnectionResetError, BrokenPipeError, urllib.error.URLError):
        pass  # refused while the client was still sending: the same refusal
    # With it: over the call's bound, a 400 that says so, before a byte of
    # the body is read when its length says so (only the headers are sent
    # here, so no client's write races the answer), and while it is read
    # when it does not (chunked).
    host, port = w.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/sandboxes")
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(4 << 20))
    conn.endheaders()
    answer = conn.getresponse()
    raw = answer.read()
    conn.close()
    assert answer.status == 400 and "at most" in json.loads(raw)["error"]["message"], raw[:300]
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"id": "x" * (4 << 20)}).encode()
    try:
        conn.request(
            "POST",
            "/v1/sandboxes",
            body=iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        answer = conn.getresponse()
        raw = answer.read()
        assert answer.status == 400 and "at most" in json.loads(raw)["error"]["message"], raw
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered and closed while the client still sent: the same refusal
    conn.close()
    # Bodies that never come: each holds its own length of the budget, not
    # its call's bound, so another caller is answered at once; each is
    # refused once it has been silent for 10 s.
    stalled = []
    for _ in range(3):
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.putrequest("POST", "/v1/sandboxes/nothing/operations")
        c.putheader("Authorization", f"Bearer {token}")
        c.putheader("Content-Type", "application/json")
        c.putheader("Content-Length", "100")
        c.endheaders()
        stalled.append(c)
    started = time.monotonic()
    status, _, raw = fetch(f"{w.url}/v1/sandboxes", token)
    assert status == 200 and time.monotonic() - started < 5, raw
    for c in stalled:
        answer = c.getresponse()
        raw = answer.read()
        assert answer.status == 400 and "did not come" in raw.decode(), raw
        c.close()
    # A path of nothing: a JSON 404, never an empty 200.
    for method, path in [("GET", "/v1/nothing"), ("PUT", "/v1/sandbox/x/archive")]:
        status, ctype, raw = fetch(f"{w.url}{path}", token, method)
        assert (status, ctype) == (404, "application/json"), (path, status, raw)
        assert json.loads(raw)["error"]["code"] == "NOT_FOUND"
    sb = w.create()
    try:
        # The query never overrides the path.
        status, _, raw = fetch(f"{w.url}/v1/sandboxes/no-such?id={sb.id}", token)
        assert status == 404, raw
        # HEAD would make the call: refused.
        req = urllib.request.Request(
            f"{w.url}/v1/sandboxes/{sb.id}/archive?path=/workspace", method="HEAD"
        )
        req.add_header("Authorization", f"Bearer {token}")
        with pytest.raises(urllib.error.HTTPError) as head:
            urllib.request.urlopen(req, timeout=30)
        assert head.value.code == 405
        # A query that is not UTF-8 once decoded.
        status, _, raw = fetch(f"{w.url}/v1/sandboxes/{sb.id}/archive?path=%ff", token)
        assert status == 400, raw
        # A stream of requests with a bad line: a 400, not a server error.
        req = urllib.request.Request(
            f"{w.url}/v1/corral.v1.Worker/BuildImage",
            data=b'{"dockerfile": "Dockerfile"}\nnot json\n',
            method="POST",
        )
        req.add_header("Authorization", f"Bearer {token}")
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(req, timeout=30)
        assert bad.value.code == 400, bad.value.read()
        # A quiet stream (a watch with nothing new) has its headers all the
        # same: proxies and clients see it open.
        conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=10)
        conn.request(
            "GET",
            f"/v1/sandboxes/{sb.id}/events?after_seq=1000000",
            headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"},
        )
        quiet = conn.getresponse()
        assert quiet.status == 200 and quiet.getheader("Content-Type") == "text/event-stream"
        conn.close()
        # The worker is whole: a command runs.
        assert sb.run("echo fine").stdout == "fine\n"
    finally:
        sb.remove()

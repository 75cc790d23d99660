"""`corral mcp` driven by the `mcp` package's own client (PyPI) over stdio,
against a real worker and through a front door, and over Streamable HTTP
on a front door (a tenant's key as its Bearer; a missing or wrong one 401
naming the protected-resource metadata; a session its key's alone): the tools are listed with
their schemas and hints; a sandbox is made at the first call; a command,
a file written and read back, a command that fails and one that times out
are tool results (the session goes on); an unknown tool is a protocol
error; the session's sandbox is gone when the client is; a wrong key is
refused before anything is served."""

from __future__ import annotations

import base64
import http.client
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jsonschema
import pytest
from conftest import BIN_DIR, Client, FrontDoor, Worker
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client


def server(worker: Client, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=str(BIN_DIR / "corral"),
        args=[
            "--worker",
            worker.url,
            "--token-file",
            str(worker.token_file),
            "mcp",
            "--image",
            "corral-debian:latest",
            *extra,
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
    )


# The first message of a session, as a client sends it.
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"},
    },
}


def text_of(result: Any) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


async def session_run(worker: Client) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with (
        stdio_client(server(worker)) as (read, write),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        seen["version"] = init.protocol_version
        tools = (await session.list_tools()).tools
        seen["tools"] = {t.name: t for t in tools}

        r = await session.call_tool("run_command", {"command": "python3 -c 'print(6*7)'"})
        seen["run"] = r
        sandbox = r.structured_content["sandbox_id"]
        seen["sandbox"] = sandbox
        seen["listed"] = {s.id for s in worker.list()}

        w = await session.call_tool(
            "write_file", {"path": "src/hello.py", "content": "print('hi there')\n"}
        )
        seen["write"] = w
        seen["read"] = await session.call_tool("read_file", {"path": "src/hello.py"})
        seen["ran"] = await session.call_tool("run_command", {"command": "python3 src/hello.py"})
        seen["fails"] = await session.call_tool("run_command", {"command": "echo oops >&2; exit 3"})
        seen["slow"] = await session.call_tool(
            "run_command", {"command": "echo started; sleep 30", "timeout_seconds": 1}
        )
        seen["missing"] = await session.call_tool("read_file", {"path": "/workspace/nope"})
        seen["after"] = await session.call_tool("run_command", {"command": "echo still here"})
        # A misspelled argument is refused, never taken for its default.
        seen["misspelled"] = await session.call_tool(
            "run_command", {"command": "true", "timeout": 1}
        )
        # Background processes: one that ends, one stopped; their output.
        started = await session.call_tool(
            "start_process",
            {"command": "for i in 1 2 3; do echo tick $i; sleep 0.3; done; exit 4"},
        )
        seen["started"] = started
        forever = await session.call_tool("start_process", {"command": "echo up; sleep 600"})
        await anyio.sleep(2)
        seen["ended"] = await session.call_tool(
            "read_process", {"process_id": started.structured_content["process_id"]}
        )
        seen["running"] = await session.call_tool(
            "read_process", {"process_id": forever.structured_content["process_id"]}
        )
        seen["stop"] = await session.call_tool(
            "stop_process", {"process_id": forever.structured_content["process_id"]}
        )
        await anyio.sleep(1)
        seen["stopped"] = await session.call_tool(
            "read_process", {"process_id": forever.structured_content["process_id"]}
        )
        seen["ls"] = await session.call_tool("list_files", {"path": "src"})
        seen["ls_missing"] = await session.call_tool("list_files", {"path": "nowhere"})
        # Any bytes in and out, as base64.
        blob = bytes(range(256)) * 64
        seen["blob"] = blob
        seen["upload"] = await session.call_tool(
            "upload_file",
            {
                "path": "bin/blob.dat",
                "content_base64": base64.b64encode(blob).decode(),
                "executable": True,
            },
        )
        seen["download"] = await session.call_tool("download_file", {"path": "bin/blob.dat"})
        seen["mode"] = await session.call_tool(
            "run_command", {"command": "stat -c %a bin/blob.dat"}
        )
        seen["not_b64"] = await session.call_tool(
            "upload_file", {"path": "x", "content_base64": "not base64 at all!"}
        )
        # Forked: the children have the session's files and are its own.
        seen["fork"] = await session.call_tool("fork_sandbox", {"count": 2})
        children = seen["fork"].structured_content["children"]
        seen["in_child"] = await session.call_tool(
            "run_command", {"command": "cat src/hello.py", "sandbox_id": children[0]}
        )
        seen["listed_forked"] = {s.id for s in worker.list()}
        # Egress: not on a sandbox made without; on one made with it, within
        # what the worker allows.
        seen["egress_without"] = await session.call_tool("set_egress", {"rules": []})
        seen["egress_made"] = await session.call_tool("create_sandbox", {"egress": []})
        seen["egress_set"] = await session.call_tool("set_egress", {"rules": ["example.org:443"]})
        seen["egress_beyond"] = await session.call_tool("set_egress", {"rules": ["pypi.org:443"]})
        seen["egress_bad"] = await session.call_tool("set_egress", {"rules": ["no such rule"]})
        try:
            await session.call_tool("no_such_tool", {})
            seen["unknown"] = None
        except Exception as e:  # the client raises the protocol error
            seen["unknown"] = e
    return seen


@pytest.mark.timeout(180)
def test_an_agent_uses_a_sandbox_through_corral_mcp(worker: Client) -> None:
    seen = anyio.run(session_run, worker)
    assert seen["version"] == "2025-11-25"
    tools = seen["tools"]
    assert set(tools) >= {
        "run_command",
        "read_file",
        "write_file",
        "create_sandbox",
        "list_sandboxes",
        "remove_sandbox",
    }
    run = tools["run_command"]
    assert run.input_schema["required"] == ["command"]
    assert run.annotations.destructive_hint is True
    assert tools["read_file"].annotations.read_only_hint is True

    r = seen["run"]
    assert not r.is_error, text_of(r)
    assert r.structured_content["stdout"] == "42\n" and r.structured_content["exit_code"] == 0
    assert "42" in text_of(r)
    assert seen["sandbox"] in seen["listed"]
    assert not seen["write"].is_error, text_of(seen["write"])
    assert seen["read"].structured_content["content"] == "print('hi there')\n"
    assert seen["ran"].structured_content["stdout"] == "hi there\n"

    fails = seen["fails"]
    assert fails.is_error and fails.structured_content["exit_code"] == 3
    assert "oops" in fails.structured_content["stderr"]
    slow = seen["slow"]
    assert slow.is_error and "timed out" in text_of(slow), text_of(slow)
    assert "started" in slow.structured_content["stdout"]
    assert seen["missing"].is_error and "nope" in text_of(seen["missing"])
    assert seen["after"].structured_content["stdout"] == "still here\n"
    misspelled = seen["misspelled"]
    assert misspelled.is_error and "timeout_seconds" in text_of(misspelled), text_of(misspelled)
    assert seen["unknown"] is not None
    assert {
        "start_process",
        "read_process",
        "stop_process",
        "list_files",
        "expose_port",
        "upload_file",
        "download_file",
        "fork_sandbox",
        "set_egress",
    } <= set(tools)
    assert not seen["started"].is_error, text_of(seen["started"])
    ended = seen["ended"].structured_content
    assert not ended["running"] and ended["exit_code"] == 4, ended
    assert ended["output"] == "tick 1\ntick 2\ntick 3\n", ended
    running = seen["running"].structured_content
    assert running["running"] and running["output"] == "up\n", running
    assert not seen["stop"].is_error, text_of(seen["stop"])
    stopped = seen["stopped"].structured_content
    assert not stopped["running"] and stopped["state"] == "canceled", stopped
    entries = seen["ls"].structured_content["entries"]
    assert entries == [{"name": "hello.py", "type": "file", "size": 18}], entries
    assert seen["ls_missing"].is_error and "nowhere" in text_of(seen["ls_missing"])

    up = seen["upload"]
    assert not up.is_error and up.structured_content["bytes"] == len(seen["blob"]), text_of(up)
    down = seen["download"]
    assert not down.is_error, text_of(down)
    assert down.structured_content["size"] == len(seen["blob"])
    resource = down.content[1].resource
    assert resource.mime_type == "application/octet-stream"
    assert base64.b64decode(resource.blob) == seen["blob"]
    assert seen["mode"].structured_content["stdout"] == "755\n"
    assert seen["not_b64"].is_error and "base64" in text_of(seen["not_b64"])
    fork = seen["fork"]
    assert not fork.is_error, text_of(fork)
    children = fork.structured_content["children"]
    assert len(children) == 2 and set(children) <= seen["listed_forked"]
    assert seen["in_child"].structured_content["stdout"] == "print('hi there')\n"
    without = seen["egress_without"]
    assert without.is_error and "made without egress" in text_of(without), text_of(without)
    assert not seen["egress_made"].is_error, text_of(seen["egress_made"])
    assert seen["egress_set"].structured_content["rules"] == ["example.org:443"], text_of(
        seen["egress_set"]
    )
    beyond = seen["egress_beyond"]
    assert beyond.is_error and "--allow-egress" in text_of(beyond), text_of(beyond)
    assert seen["egress_bad"].is_error and "rules" in text_of(seen["egress_bad"])

    # The client is gone: so are the sandboxes its session made, forks too.
    left = {s.id for s in worker.list()}
    assert seen["sandbox"] not in left
    assert not set(children) & left, left


def test_a_wrong_token_is_refused_before_anything_is_served(worker: Client, tmp_path: Any) -> None:
    bad = tmp_path / "token"
    bad.write_text("not-the-token-at-all-0123456789\n")
    bad.chmod(0o600)

    async def attempt() -> None:
        params = server(worker)
        params.args[params.args.index("--token-file") + 1] = str(bad)
        async with (
            stdio_client(params) as (read, write),
            ClientSession(read, write, read_timeout_seconds=20) as session,
        ):
            await session.initialize()

    with pytest.raises(BaseException):  # noqa: B017 - the client's own error, whatever it is
        anyio.run(attempt)


async def auditor_run(url: str, key: str, sandbox: str) -> dict[str, Any]:
    """What a key that may only read is offered, and sees of ``sandbox``."""
    seen: dict[str, Any] = {}
    client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"})
    async with (
        client,
        streamable_http_client(url, http_client=client) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        seen["tools"] = {t.name for t in (await session.list_tools()).tools}
        seen["listed"] = await session.call_tool("list_sandboxes", {})
        seen["inspected"] = await session.call_tool("inspect_sandbox", {"sandbox_id": sandbox})
        seen["no_id"] = await session.call_tool("inspect_sandbox", {})
    return seen


async def http_session_run(url: str, key: str, auditor: str) -> dict[str, Any]:
    """The same session over Streamable HTTP, with ``key`` as its Bearer;
    an auditor's session (``auditor``) looks at its sandbox meanwhile."""
    seen: dict[str, Any] = {}
    client = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(30, read=300)
    )
    async with (
        client,
        streamable_http_client(url, http_client=client) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        init = await session.initialize()
        seen["version"] = init.protocol_version
        seen["tools"] = {t.name for t in (await session.list_tools()).tools}
        r = await session.call_tool("run_command", {"command": "python3 -c 'print(6*7)'"})
        seen["run"] = r
        seen["sandbox"] = r.structured_content["sandbox_id"]
        seen["write"] = await session.call_tool(
            "write_file", {"path": "notes.txt", "content": "over http\n"}
        )
        seen["read"] = await session.call_tool("read_file", {"path": "notes.txt"})
        seen["fails"] = await session.call_tool("run_command", {"command": "exit 3"})
        seen["slow"] = await session.call_tool(
            "run_command", {"command": "sleep 30", "timeout_seconds": 1}
        )
        seen["after"] = await session.call_tool("run_command", {"command": "echo still here"})
        seen["auditor"] = await auditor_run(url, auditor, seen["sandbox"])
    return seen


@pytest.mark.timeout(180)
def test_an_agent_uses_corral_mcp_over_http_on_a_front_door(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker()
    (tmp_path / "door").mkdir()
    door = FrontDoor(tmp_path / "door", w)
    try:
        url = f"{door.url}/mcp"
        seen = anyio.run(http_session_run, url, door.acme, door.auditor)
        assert seen["version"] == "2025-11-25"
        assert {"run_command", "read_file", "write_file"} <= seen["tools"]
        r = seen["run"]
        assert not r.is_error and r.structured_content["stdout"] == "42\n", text_of(r)
        assert seen["read"].structured_content["content"] == "over http\n"
        assert seen["fails"].is_error and seen["fails"].structured_content["exit_code"] == 3
        assert seen["slow"].is_error and "timed out" in text_of(seen["slow"])
        assert seen["after"].structured_content["stdout"] == "still here\n"
        # The session's sandbox was the tenant's, and went with the session.
        assert seen["sandbox"] not in {s.id for s in w.list()}

        # A key that may only read is offered what runs nothing in a
        # sandbox: it lists the tenant's sandboxes and inspects one (what
        # ran in it, how it ended), and makes none.
        audit = seen["auditor"]
        assert audit["tools"] == {"list_sandboxes", "inspect_sandbox"}, audit["tools"]
        rows = audit["listed"].structured_content["sandboxes"]
        assert [r["sandbox_id"] for r in rows] == [seen["sandbox"]], rows
        inspected = audit["inspected"]
        assert not inspected.is_error, text_of(inspected)
        info = inspected.structured_content
        assert info["state"] == "ready" and info["image"], info
        commands = [o["what"] for o in info["last_operations"] if o["kind"] == "shell"]
        assert "exit 3" in commands and "sleep 30" in commands, info
        outcomes = {o["what"]: o["outcome"] for o in info["last_operations"]}
        assert "3" in outcomes["exit 3"], outcomes
        assert audit["no_id"].is_error and "sandbox_id" in text_of(audit["no_id"])

        # No key, a wrong one: 401 naming the protected-resource metadata.
        init = INITIALIZE
        for key in (None, "not-a-key"):
            req = urllib.request.Request(url, data=json.dumps(init).encode(), method="POST")
            req.add_header("Content-Type", "application/json")
            req.add_header("Accept", "application/json, text/event-stream")
            if key:
                req.add_header("Authorization", f"Bearer {key}")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 401
            challenge = e.value.headers["WWW-Authenticate"]
            assert "oauth-protected-resource" in challenge, challenge
        meta_url = challenge.split('resource_metadata="')[1].rstrip('"')
        with urllib.request.urlopen(meta_url, timeout=30) as r2:
            meta = json.loads(r2.read())
        assert meta["resource"] == url and meta["bearer_methods_supported"] == ["header"]

        # A session is its key's: another tenant's key does not reach it.
        req = urllib.request.Request(url, data=json.dumps(init).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {door.acme}")
        with urllib.request.urlopen(req, timeout=30) as r3:
            sid = r3.headers["Mcp-Session-Id"]
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        req = urllib.request.Request(url, data=json.dumps(ping).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {door.bolt}")
        req.add_header("Mcp-Session-Id", sid)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404
    finally:
        door.stop()


def mcp_post(
    url: str, key: str, msg: dict[str, Any], sid: str | None = None, timeout: float = 60
) -> tuple[int, dict[str, str], Any]:
    """One JSON-RPC message to ``url`` with ``key``: status, headers, JSON."""
    req = urllib.request.Request(url, data=json.dumps(msg).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Accept", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    if sid:
        req.add_header("Mcp-Session-Id", sid)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            headers = {k.lower(): v for k, v in r.headers.items()}
            return r.status, headers, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        headers = {k.lower(): v for k, v in e.headers.items()}
        return e.code, headers, json.loads(e.read() or b"null")


def mcp_open(url: str, key: str) -> str:
    status, headers, _ = mcp_post(url, key, INITIALIZE)
    assert status == 200, status
    return headers["mcp-session-id"]


def tool(url: str, key: str, sid: str, n: int, name: str, args: dict[str, Any]) -> Any:
    status, _, body = mcp_post(
        url,
        key,
        {
            "jsonrpc": "2.0",
            "id": n,
            "method": "tools/call",
            "params": {"name": name, "arguments": args},
        },
        sid,
    )
    assert status == 200, (status, body)
    return body["result"]


@pytest.mark.timeout(240)
def test_mcp_over_http_holds_up_to_a_hostile_or_careless_client(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    """A call longer than the first-call timeout on one connection; a
    3 MB upload; a DELETE whose client leaves at once still removes every
    sandbox; one key cannot take every session; a Host header that would
    break the challenge is not echoed."""
    w = own_worker()
    (tmp_path / "door").mkdir()
    door = FrontDoor(tmp_path / "door", w)
    try:
        url = f"{door.url}/mcp"
        sid = mcp_open(url, door.acme)
        # One keep-alive connection, a call past admission's 10 s.
        client = httpx2.Client(
            headers={"Authorization": f"Bearer {door.acme}", "Mcp-Session-Id": sid},
            timeout=60,
        )
        with client:
            r = client.post(
                url,
                json={
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "tools/call",
                    "params": {
                        "name": "run_command",
                        "arguments": {"command": "sleep 12; echo late"},
                    },
                },
                headers={"Accept": "application/json"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["result"]["structuredContent"]["stdout"] == "late\n"
        blob = os.urandom(3_000_000)
        up = tool(
            url,
            door.acme,
            sid,
            3,
            "upload_file",
            {"path": "big.bin", "content_base64": base64.b64encode(blob).decode()},
        )
        assert not up["isError"] and up["structuredContent"]["bytes"] == len(blob), up
        made = tool(url, door.acme, sid, 4, "fork_sandbox", {"count": 3})
        ids = {*made["structuredContent"]["children"], made["structuredContent"]["sandbox_id"]}
        assert len(ids) == 4 and ids <= {s.id for s in w.list()}
        # The client gives up on its DELETE at once: the session still ends
        # whole.
        req = urllib.request.Request(url, method="DELETE")
        req.add_header("Authorization", f"Bearer {door.acme}")
        req.add_header("Mcp-Session-Id", sid)
        with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
            urllib.request.urlopen(req, timeout=0.05)
        deadline = time.monotonic() + 60
        while ids & {s.id for s in w.list()} and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ids & {s.id for s in w.list()}, "sandboxes left behind"

        # One key: at most 64 sessions; another tenant's still opens.
        mine = [mcp_open(url, door.bolt) for _ in range(64)]
        status, _, body = mcp_post(
            url,
            door.bolt,
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
        )
        assert status == 429 and "64" in body["error"]["message"], body
        acme = mcp_open(url, door.acme)
        for s in [*mine, acme]:
            req = urllib.request.Request(url, method="DELETE")
            req.add_header("Authorization", f"Bearer {door.bolt if s != acme else door.acme}")
            req.add_header("Mcp-Session-Id", s)
            with urllib.request.urlopen(req, timeout=30) as r2:
                assert r2.status == 200

        # A Host that would end the quoted challenge is not echoed.
        conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=30)
        conn.request("POST", "/mcp", body=b"{}", headers={"Host": 'evil.example"x=y'})
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 401
        assert "evil" not in answer.getheader("WWW-Authenticate", ""), answer.getheader(
            "WWW-Authenticate"
        )
        conn.close()
    finally:
        door.stop()


def test_a_request_id_in_use_is_refused_and_the_first_call_goes_on(worker: Client) -> None:
    """Over stdio: two tool calls with one id: the second is refused, the
    first answers, and ending the session leaves no sandbox."""
    params = server(worker)
    proc = subprocess.Popen(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=params.env,
    )
    assert proc.stdin and proc.stdout

    def call(n: int, cmd: str) -> dict[str, Any]:
        return {
            "jsonrpc": "2.0",
            "id": n,
            "method": "tools/call",
            "params": {"name": "run_command", "arguments": {"command": cmd}},
        }

    for msg in [
        INITIALIZE,
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        call(7, "sleep 2; echo first"),
        call(7, "echo second"),
    ]:
        proc.stdin.write(json.dumps(msg).encode() + b"\n")
        proc.stdin.flush()
    answers = [json.loads(proc.stdout.readline()) for _ in range(3)]
    proc.stdin.close()
    assert proc.wait(60) == 0
    refused = [a for a in answers if "error" in a]
    assert len(refused) == 1 and refused[0]["id"] == 7, answers
    assert "still running" in refused[0]["error"]["message"]
    done = [a for a in answers if a.get("id") == 7 and "result" in a]
    assert done and done[0]["result"]["structuredContent"]["stdout"] == "first\n", answers


async def conformance(session: ClientSession) -> dict[str, Any]:
    """What an MCP Inspector-style pass checks of a session."""
    seen: dict[str, Any] = {}
    init = await session.initialize()
    seen["capabilities"] = init.capabilities
    listed = await session.list_tools()
    seen["tools"] = listed.tools
    seen["next"] = listed.next_cursor
    try:
        await session.list_tools(params=types.PaginatedRequestParams(cursor="not-a-cursor"))
        seen["bad_cursor"] = None
    except Exception as e:  # the client raises the protocol error
        seen["bad_cursor"] = e
    notes: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        notes.append((progress, message))

    seen["progressed"] = await session.call_tool(
        "run_command",
        {"command": "for i in 1 2 3 4 5; do echo step $i; sleep 0.6; done"},
        progress_callback=on_progress,
    )
    seen["progress"] = notes
    # A call canceled while its command runs: the command ends in the sandbox.
    with anyio.move_on_after(2):
        await session.call_tool(
            "run_command",
            {"command": "touch started; sleep 4; touch finished", "timeout_seconds": 60},
        )
    await anyio.sleep(5)
    seen["after_cancel"] = await session.call_tool(
        "run_command", {"command": "ls started finished 2>&1; true"}
    )
    return seen


def check_conformance(seen: dict[str, Any]) -> None:
    assert seen["capabilities"].tools is not None
    for t in seen["tools"]:
        # Each schema a valid JSON Schema, of an object; each tool described.
        jsonschema.Draft202012Validator.check_schema(t.input_schema)
        assert t.input_schema["type"] == "object" and t.description, t.name
        if t.output_schema is not None:
            jsonschema.Draft202012Validator.check_schema(t.output_schema)
    assert seen["next"] is None
    assert seen["bad_cursor"] is not None
    r = seen["progressed"]
    assert not r.is_error and r.structured_content["stdout"].count("step") == 5, text_of(r)
    notes = seen["progress"]
    assert notes and any("step" in (m or "") for _, m in notes), notes
    assert [p for p, _ in notes] == sorted(p for p, _ in notes), notes
    listing = seen["after_cancel"].structured_content["stdout"]
    assert "started" in listing and "'finished': No such file" in listing, listing


@pytest.mark.timeout(180)
def test_an_inspector_style_pass_over_stdio_and_http(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker("--allow-image", "corral-debian:latest")

    async def over_stdio() -> dict[str, Any]:
        async with (
            stdio_client(server(w)) as (read, write),
            ClientSession(read, write) as session,
        ):
            return await conformance(session)

    check_conformance(anyio.run(over_stdio))
    (tmp_path / "door").mkdir()
    door = FrontDoor(tmp_path / "door", w)
    try:

        async def over_http() -> dict[str, Any]:
            client = httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {door.acme}"},
                timeout=httpx2.Timeout(30, read=300),
            )
            async with (
                client,
                streamable_http_client(f"{door.url}/mcp", http_client=client) as streams,
                ClientSession(streams[0], streams[1]) as session,
            ):
                return await conformance(session)

        check_conformance(anyio.run(over_http))
    finally:
        door.stop()

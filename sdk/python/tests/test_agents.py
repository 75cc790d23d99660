"""The OpenAI Agents SDK from PyPI drives CorralSandboxClient: its own
sandbox test helpers (from its sdist: the tests of the version installed)
on a Corral session, resume by reattaching and by hydrating a replacement,
and a SandboxAgent run by the SDK's Runner against a scripted model server
on loopback, resumed from its serialized state in a new process."""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO, Client, Worker, free_port

pytest.importorskip("agents")

from agents.editor import ApplyPatchOperation
from agents.sandbox import LocalSnapshotSpec, Manifest
from agents.sandbox.entries import File

import corral
from corral.agents import (
    CorralSandboxClient,
    CorralSandboxClientOptions,
    CorralSandboxSessionState,
)

IMAGE = "corral-debian:latest"


@pytest.fixture(scope="session")
def sdk_helpers() -> ModuleType:
    """tests/sandbox/integration_tests/_helpers.py of the installed SDK's sdist
    (sdk/python/test.sh fetches it into target/pypi)."""
    version = importlib.metadata.version("openai-agents")
    root = REPO / "target" / "pypi" / f"openai_agents-{version}"
    helpers = root / "tests" / "sandbox" / "integration_tests" / "_helpers.py"
    assert helpers.exists(), f"{helpers} is missing: sdk/python/test.sh fetches it"
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("tests.sandbox.integration_tests._helpers")
    finally:
        sys.path.remove(str(root))


def sid(session: Any) -> str:
    state = session.state
    assert isinstance(state, CorralSandboxSessionState)
    out: str = state.sandbox_id
    return out


def client(worker: Client) -> CorralSandboxClient:
    return CorralSandboxClient(worker=worker.url, token_file=str(worker.token_file))


def test_the_sdks_helpers_pass_and_a_session_resumes_both_ways(
    worker: Client, sdk_helpers: ModuleType, tmp_path: Path
) -> None:
    h = sdk_helpers

    async def main() -> None:
        c = client(worker)
        manifest = Manifest(
            entries={"seed.txt": File(content=b"seed\n"), "dir/nested.txt": File(content=b"n\n")}
        )
        session = await c.create(
            manifest=manifest,
            snapshot=LocalSnapshotSpec(base_path=tmp_path / "snaps"),
            options=CorralSandboxClientOptions(image=IMAGE),
        )
        async with session:
            await h.assert_workspace_texts(session, {"seed.txt": "seed\n", "dir/nested.txt": "n\n"})
            await h.write_workspace_text(session, "made/by/agent.txt", "agent\n")
            await session.apply_patch(
                ApplyPatchOperation(type="create_file", path="patched.txt", diff="+patched\n")
            )
            await h.assert_workspace_texts(
                session, {"made/by/agent.txt": "agent\n", "patched.txt": "patched"}
            )
            await h.assert_workspace_missing(session, "nope.txt")
            for path in ("../outside.txt", "/tmp/sandbox-outside.txt"):
                await h._assert_read_blocked(session, path)
                await h._assert_write_blocked(session, path)
                await h._assert_patch_blocked(session, path)
            r = await session.exec("pwd; echo $0", shell=["sh", "-c"])
            assert r.ok() and r.stdout.decode().split() == ["/workspace", "sh"]
            r = await session.exec("exit 3", shell=["sh", "-c"])
            assert r.exit_code == 3
            payload = json.dumps(c.serialize_session_state(session.state))
        first = sid(session)

        # The program that made it is gone (nothing deleted): a new client
        # picks up the same sandbox.
        c2 = client(worker)
        again = await c2.resume(c2.deserialize_session_state(json.loads(payload)))
        async with again:
            assert sid(again) == first
            await h.assert_workspace_texts(again, {"made/by/agent.txt": "agent\n"})
        await c2.delete(again)
        with pytest.raises(corral.SandboxNotFound):
            await corral.AsyncSandbox.connect(first, worker.url, token_file=str(worker.token_file))

        # Its sandbox is gone: a replacement, hydrated from the snapshot.
        c3 = client(worker)
        fresh = await c3.resume(c3.deserialize_session_state(json.loads(payload)))
        async with fresh:
            assert sid(fresh) != first
            await h.assert_workspace_texts(
                fresh,
                {"seed.txt": "seed\n", "made/by/agent.txt": "agent\n", "patched.txt": "patched"},
            )
        await c3.delete(fresh)

    asyncio.run(main())


RUNNER_SCRIPT = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
    + textwrap.dedent("""
    import asyncio, json, sys, threading
    from chat_rules import invalid
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path
    from openai import AsyncOpenAI
    from agents import OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from agents.run_state import RunState
    from agents.sandbox import LocalSnapshotSpec, SandboxAgent, SandboxRunConfig
    from agents.sandbox.capabilities import Shell
    from corral.agents import CorralSandboxClient, CorralSandboxClientOptions

    phase, worker, token, state_file, snaps = sys.argv[1:6]
    SCRIPTS = {
        "1": [
            {"cmd": "printf 'def add(a, b):\\\\n    return a - b\\\\n' > calc.py && cat calc.py"},
            {"cmd": "sed -i 's/a - b/a + b/' calc.py && "
                    "python3 -c 'import calc; print(calc.add(2, 3))'"},
            {"approve": True},
        ],
        "2": [
            {"cmd": "cat calc.py; python3 -c 'import calc; print(calc.add(20, 22))'"},
            {"content": "done"},
        ],
    }
    script = SCRIPTS[phase]
    seen = []

    class Model(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def refuse(self, why):
            # As OpenAI answers a request it will not take.
            data = json.dumps({"error": {"message": why, "type": "invalid_request_error"}})
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            why = invalid(body)
            if why:
                print("REFUSED", why, flush=True)
                return self.refuse(why)
            seen.append(body)
            step = script[len(seen) - 1]
            n = len(seen)
            if "cmd" in step:
                msg = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{phase}_{n}", "type": "function", "function": {
                        "name": "exec_command", "arguments": json.dumps({"cmd": step["cmd"]})}}]}
            elif "approve" in step:
                msg = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{phase}_{n}", "type": "function",
                    "function": {"name": "approval_tool", "arguments": "{}"}}]}
            else:
                msg = {"role": "assistant", "content": step["content"]}
            finish = "tool_calls" if "tool_calls" in msg else "stop"
            reply = {"id": f"c{n}", "object": "chat.completion", "created": 0,
                     "model": "scripted",
                     "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    @function_tool(name_override="approval_tool", needs_approval=True)
    def approval_tool() -> str:
        return "approved"

    async def main():
        server = ThreadingHTTPServer(("127.0.0.1", 0), Model)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        model = OpenAIChatCompletionsModel(model="scripted", openai_client=AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="unused"))
        agent = SandboxAgent(name="coder", model=model, instructions="fix calc.py",
                             capabilities=[Shell()], tools=[approval_tool])
        client = CorralSandboxClient(worker=worker, token_file=token)
        config = RunConfig(tracing_disabled=True, sandbox=SandboxRunConfig(
            client=client, options=CorralSandboxClientOptions(image="corral-debian:latest"),
            snapshot=LocalSnapshotSpec(base_path=Path(snaps))))
        if phase == "1":
            result = await Runner.run(agent, "fix calc.py", run_config=config)
            assert len(result.interruptions) == 1, result
            Path(state_file).write_text(json.dumps(result.to_state().to_json()))
        else:
            state = await RunState.from_json(agent, json.loads(Path(state_file).read_text()))
            state.approve(state.get_interruptions()[0])
            result = await Runner.run(agent, state, run_config=config)
            print("FINAL", result.final_output)
        for body in seen[1:]:
            for m in body["messages"]:
                if m["role"] == "tool":
                    print("TOOL", json.dumps(m["content"]))
        server.shutdown()

    asyncio.run(main())
""")
)


def test_a_sandbox_agent_runs_in_corral_and_resumes_in_a_new_process(
    worker: Client, tmp_path: Path
) -> None:
    script = tmp_path / "run.py"
    script.write_text(RUNNER_SCRIPT)
    args = [
        str(worker.url),
        str(worker.token_file),
        str(tmp_path / "state.json"),
        str(tmp_path / "snaps"),
    ]

    def phase(n: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, str(script), n, *args], capture_output=True, text=True, timeout=180
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    one = phase("1")
    tools = [json.loads(line[5:]) for line in one if line.startswith("TOOL ")]
    assert any("return a - b" in t for t in tools), tools
    assert any(t.rstrip().endswith("5") for t in tools), tools
    two = phase("2")
    tools = [json.loads(line[5:]) for line in two if line.startswith("TOOL ")]
    # The edit made before the pause is there after it, in a new process.
    assert any("return a + b" in t and "42" in t for t in tools), tools
    assert "FINAL done" in two
    # Every sandbox the runs made is gone: the Runner deletes what it owns.
    left: list[Any] = corral.list_sandboxes(
        worker.url, labels=None, token_file=str(worker.token_file)
    )
    assert not [s for s in left if "agents.session_id" in s.labels], left


def test_pty_sessions_as_the_sdks_own_pty_tests_drive_them(worker: Client) -> None:
    # The steps and checks of the SDK's TestUnixLocalPty, on a Corral session.
    from agents.sandbox.errors import PtySessionNotFoundError

    async def main() -> None:
        c = client(worker)
        session = await c.create(manifest=Manifest(), snapshot=None, options=None)
        async with session:
            started = await session.pty_exec_start(
                "sh",
                "-c",
                "IFS= read -r line; printf '%s\\n' \"$line\"",
                shell=False,
                tty=True,
                yield_time_s=0.05,
            )
            assert started.process_id is not None and started.exit_code is None
            written = await session.pty_write_stdin(
                session_id=started.process_id, chars="hello from pty\n", yield_time_s=2
            )
            assert written.process_id is None and written.exit_code == 0
            assert "hello from pty" in written.output.decode("utf-8", "replace")
            with pytest.raises(PtySessionNotFoundError):
                await session.pty_write_stdin(session_id=started.process_id, chars="")
            with pytest.raises(PtySessionNotFoundError):
                await session.pty_write_stdin(session_id=999_999, chars="")

            # Ctrl-C interrupts a long-running process on its terminal.
            started = await session.pty_exec_start(
                "sleep", "30", shell=False, tty=True, yield_time_s=0.05
            )
            assert started.process_id is not None
            interrupted = await session.pty_write_stdin(
                session_id=started.process_id, chars="\x03", yield_time_s=0.25
            )
            if interrupted.process_id is not None:
                interrupted = await session.pty_write_stdin(
                    session_id=started.process_id, chars="", yield_time_s=5.5
                )
            assert interrupted.process_id is None and interrupted.exit_code is not None

            # Without a terminal: no stdin, both streams, polled to the end.
            started = await session.pty_exec_start(
                "sh",
                "-c",
                "printf 'stdout\\n'; printf 'stderr\\n' >&2; sleep 1",
                shell=False,
                tty=False,
                yield_time_s=0.5,
            )
            assert started.process_id is not None and started.exit_code is None
            text = started.output.decode("utf-8", "replace")
            assert "stdout" in text and "stderr" in text
            with pytest.raises(RuntimeError, match="stdin is not available for this process"):
                await session.pty_write_stdin(session_id=started.process_id, chars="hello")
            finished = await session.pty_write_stdin(
                session_id=started.process_id, chars="", yield_time_s=5.5
            )
            assert finished.process_id is None and finished.exit_code == 0
            assert finished.output == b""

            # Stop ends what is still running.
            started = await session.pty_exec_start(
                "sh", "-c", "printf 'ready\\n'; sleep 30", shell=False, tty=True, yield_time_s=1
            )
            assert started.process_id is not None
            assert "ready" in started.output.decode("utf-8", "replace")
        with pytest.raises(PtySessionNotFoundError):
            await session.pty_write_stdin(session_id=started.process_id, chars="")
        await c.delete(session)

    asyncio.run(main())


def test_resolve_exposed_port_gives_a_host_a_client_reaches(
    own_worker: Callable[..., Worker],
) -> None:
    """The SDK's resolve_exposed_port: the sandbox's server reached at the
    endpoint it names (the worker's host for the port, and the token)."""
    import http.client

    from agents.sandbox.errors import ExposedPortUnavailableError

    w = own_worker(
        "--ports-listen",
        f"127.0.0.1:{free_port()}",
        "--ports-domain",
        "ports.test",
        "--allow-image",
        IMAGE,
    )

    async def main() -> None:
        c = client(w)
        session = await c.create(
            manifest=Manifest(entries={"index.html": File(content=b"served\n")}),
            options=CorralSandboxClientOptions(image=IMAGE, exposed_ports=(8000,)),
        )
        async with session:
            state = session.state
            assert isinstance(state, CorralSandboxSessionState)
            sb = await corral.AsyncSandbox.connect(
                state.sandbox_id, w.url, token_file=str(w.token_file)
            )
            await sb.start("exec python3 -m http.server 8000 --bind 127.0.0.1")
            await sb.ports.wait(8000, timeout=30)
            end = await session.resolve_exposed_port(8000)
            assert end.host == f"8000-{state.sandbox_id}.ports.test" and not end.tls
            assert end.query.startswith("token=")
            token = end.query.split("=", 1)[1]
            # The endpoint's host reaches the listener (no DNS here: its
            # address, with the endpoint's host named).
            conn = http.client.HTTPConnection("127.0.0.1", end.port, timeout=30)
            conn.request(
                "GET",
                "/",
                headers={"Host": f"{end.host}:{end.port}", "Authorization": f"Bearer {token}"},
            )
            r = conn.getresponse()
            assert (r.status, b"served" in r.read()) == (200, True)
            conn.close()
            # A port the session was not given is refused by the SDK itself.
            with pytest.raises(ExposedPortUnavailableError):
                await session.resolve_exposed_port(9000)

    asyncio.run(main())

"""The OpenAI Agents SDK (PyPI) driving ``corral mcp`` through its own MCP
clients, over stdio (``MCPServerStdio``) and over Streamable HTTP on a front
door (``MCPServerStreamableHttp`` with a tenant's key), with a scripted model
server on loopback that holds each request to Chat Completions' rules: the
agent writes a program with ``write_file``, runs it with ``run_command``,
and answers with what it printed; the file is in the sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner
from agents.mcp import MCPServerStdio, MCPServerStreamableHttp
from chat_rules import invalid
from conftest import BIN_DIR, FrontDoor, Worker
from openai import AsyncOpenAI

import corral

PROGRAM = "import platform\nprint('hello from', platform.system(), 6 * 7)\n"

#: What the model does, a step a request.
STEPS: list[dict[str, Any]] = [
    {"tool": "write_file", "args": {"path": "hello.py", "content": PROGRAM}},
    {"tool": "run_command", "args": {"command": "python3 hello.py"}},
    {"answer": True},
]


class ScriptedModel:
    """A Chat Completions server on loopback playing :data:`STEPS`."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.refused: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                why = invalid(body)
                if why:
                    outer.refused.append(why)
                    return self.send(
                        400, {"error": {"message": why, "type": "invalid_request_error"}}
                    )
                outer.seen.append(body)
                n = len(outer.seen)
                step = STEPS[min(n, len(STEPS)) - 1]
                msg: dict[str, Any]
                if "tool" in step:
                    msg = {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call_{n}",
                                "type": "function",
                                "function": {
                                    "name": step["tool"],
                                    "arguments": json.dumps(step["args"]),
                                },
                            }
                        ],
                    }
                else:
                    # The answer: what the last tool said.
                    last = [m for m in body["messages"] if m["role"] == "tool"][-1]
                    msg = {"role": "assistant", "content": f"it printed: {last['content']}"}
                finish = "tool_calls" if "tool_calls" in msg else "stop"
                self.send(
                    200,
                    {
                        "id": f"c{n}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "scripted",
                        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def model(self) -> OpenAIChatCompletionsModel:
        client = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.server.server_port}/v1", api_key="unused"
        )
        return OpenAIChatCompletionsModel(model="scripted", openai_client=client)

    def stop(self) -> None:
        self.server.shutdown()


async def run_agent(server: MCPServerStdio | MCPServerStreamableHttp, model: ScriptedModel) -> str:
    async with server:
        agent = Agent(
            name="coder",
            instructions="Write hello.py and run it.",
            model=model.model(),
            mcp_servers=[server],
        )
        result = await Runner.run(
            agent, "write hello.py and run it", run_config=RunConfig(tracing_disabled=True)
        )
        return str(result.final_output)


def check(model: ScriptedModel, answer: str) -> None:
    """The run as the model saw it: the tools offered, each request valid,
    what the program printed in the tool's answer and in the agent's."""
    assert model.refused == [], model.refused
    assert len(model.seen) == 3, model.seen
    offered = {t["function"]["name"] for t in model.seen[0]["tools"]}
    assert {"run_command", "write_file", "read_file"} <= offered, offered
    ran = [m for m in model.seen[2]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "hello from Linux 42" in json.dumps(ran), ran
    assert "hello from Linux 42" in answer, answer


@pytest.mark.timeout(240)
def test_the_agents_sdk_uses_corral_mcp_over_stdio_and_over_http(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker("--allow-image", "corral-debian:latest")
    model = ScriptedModel()
    try:
        stdio = MCPServerStdio(
            params={
                "command": str(BIN_DIR / "corral"),
                "args": [
                    "--worker",
                    w.url,
                    "--token-file",
                    str(w.token_file),
                    "mcp",
                    "--image",
                    "corral-debian:latest",
                    "--keep",
                ],
                "env": {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
            },
            client_session_timeout_seconds=120,
        )
        answer = asyncio.run(run_agent(stdio, model))
        check(model, answer)
        # Kept (--keep): the program the agent wrote is in its sandbox.
        [kept] = w.list()
        with w.connect(kept.id) as sb:
            assert sb.files.read_text("hello.py") == PROGRAM
            sb.remove()

        (tmp_path / "door").mkdir()
        door = FrontDoor(tmp_path / "door", w)
        try:
            model.seen.clear()
            http = MCPServerStreamableHttp(
                params={
                    "url": f"{door.url}/mcp",
                    "headers": {"Authorization": f"Bearer {door.acme}"},
                },
                client_session_timeout_seconds=120,
            )
            answer = asyncio.run(run_agent(http, model))
            check(model, answer)
            # The session ended with the agent's run: its sandbox is gone.
            assert [s for s in corral.list_sandboxes(w.url, token_file=str(w.token_file))] == []
        finally:
            door.stop()
    finally:
        model.stop()

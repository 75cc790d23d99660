"""What the Chat Completions API refuses in a request: the rules the
scripted model servers of the agent tests hold each request to, so that a
request a real endpoint would reject fails the test."""

from __future__ import annotations

import json
from typing import Any


def invalid(body: dict[str, Any]) -> str | None:
    """What the Chat Completions API would refuse in this request."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model is required"
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "messages must be a non-empty array"
    called = set()
    for m in msgs:
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            return f"invalid role {role!r}"
        if role == "assistant":
            for c in m.get("tool_calls") or []:
                if c.get("type") != "function" or not c.get("id"):
                    return "a tool call needs an id and type function"
                json.loads(c["function"]["arguments"])
                called.add(c["id"])
        if role == "tool" and m.get("tool_call_id") not in called:
            return "messages with role 'tool' must answer a preceding tool call"
        if role in ("system", "user", "tool") and not isinstance(m.get("content"), (str, list)):
            return f"a {role} message needs content"
    for t in body.get("tools") or []:
        f = t.get("function") or {}
        if t.get("type") != "function" or not f.get("name"):
            return "a tool needs type function and a name"
        if (f.get("parameters") or {}).get("type", "object") != "object":
            return "tool parameters must be a JSON Schema object"
    return None

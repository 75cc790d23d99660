"""Checkpoint and restore from Python, as a user writes it: a gVisor sandbox
with a process counting in its memory is checkpointed, refuses commands
while it is, and comes back counting on from where it stood. Needs runsc and
the engine's experimental features (``.ci/run`` sets both)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from conftest import Client, Worker

import corral


def _count(sb: corral.Sandbox) -> int:
    out = sb.run("cat /tmp/count 2>/dev/null || echo 0").stdout.strip()
    return int(out or "0")


def test_a_checkpointed_sandbox_comes_back_where_it_stood(
    own_worker: Callable[..., Worker],
) -> None:
    w = own_worker("--allow-runtime", "runsc")
    with w.create(runtime="runsc") as sb:
        counter = sb.start(
            "n=0; while :; do n=$((n+1)); echo $n > /tmp/c.new; mv /tmp/c.new /tmp/count;"
            " sleep 0.05; done"
        )
        deadline = time.monotonic() + 30
        while _count(sb) < 5:
            assert time.monotonic() < deadline, "the loop never counted"
            time.sleep(0.05)
        info = sb.checkpoint()
        assert info.state is corral.SandboxState.CHECKPOINTED
        assert sb.info().state is corral.SandboxState.CHECKPOINTED
        with pytest.raises(corral.SandboxCheckpointed):
            sb.run("true")
        assert sb.restore().state is corral.SandboxState.READY
        first = _count(sb)
        assert first >= 5
        deadline = time.monotonic() + 30
        while _count(sb) <= first:
            assert time.monotonic() < deadline, "the loop did not go on"
            time.sleep(0.05)
        counter.kill()


def test_a_runc_sandbox_is_not_checkpointed(worker: Client) -> None:
    with worker.create() as sb:
        with pytest.raises(corral.InvalidArgument) as e:
            sb.checkpoint()
        assert e.value.reason == "not_applicable"
        assert sb.run("echo on").stdout == "on\n"

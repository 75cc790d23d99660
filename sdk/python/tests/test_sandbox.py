"""Sandboxes: made, found, listed, reset, measured and removed; the local
worker started when no worker is named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN_DIR, Client, Worker

import corral


def test_create_with_limits_env_and_lifetimes(worker: Client) -> None:
    with worker.create(
        memory="256m",
        cpus=0.5,
        pids=64,
        env={"A": "1"},
        ttl=600,
        idle_timeout=300,
        labels={"owner": "tests", "run": "7"},
    ) as sb:
        info = sb.info()
        assert info.id == sb.id and info.state is corral.SandboxState.READY
        assert (info.memory_bytes, info.cpus, info.pids) == (256 << 20, 0.5, 64)
        assert (info.ttl_s, info.idle_timeout_s) == (600, 300)
        assert sb.run("echo $A").stdout == "1\n"
        # A front door stamps its tenant's name among them.
        labels = {k: v for k, v in info.labels.items() if k != "corral.tenant"}
        assert labels == {"owner": "tests", "run": "7"}
        # Labels are the client's: never given to commands.
        assert "owner" not in sb.run("env").stdout
        tokens = str(worker.token_file)
        mine = corral.list_sandboxes(worker.url, labels={"run": "7"}, token_file=tokens)
        assert [s.id for s in mine] == [sb.id]
        assert corral.list_sandboxes(worker.url, labels={"run": "8"}, token_file=tokens) == []
        st = sb.stats()
        assert st.pids_limit == 64 and st.memory_limit_bytes > 0
        assert sb.id in {
            s.id for s in corral.list_sandboxes(worker.url, token_file=str(worker.token_file))
        }
        found = worker.connect(sb.id)
        assert found.run("echo found").stdout == "found\n"
        # Not found's to remove: its with block leaves the sandbox be.
        with found:
            pass
        assert sb.info().state is corral.SandboxState.READY
    # The with block of the one that made it removes it.
    ids = {s.id for s in corral.list_sandboxes(worker.url, token_file=str(worker.token_file))}
    assert sb.id not in ids


def test_a_sandbox_that_asks_no_limits_says_the_workers(sb: corral.Sandbox) -> None:
    # Not zeros: the worker's defaults, the ones in force.
    info = sb.info()
    assert (info.memory_bytes, info.cpus, info.pids) == (1 << 30, 1.0, 256)
    assert sb.stats().pids_limit == info.pids
    # The worker says the same of any sandbox that names none.
    w = sb.worker_info()
    assert (w.default_memory_bytes, w.default_cpus, w.default_pids) == (1 << 30, 1.0, 256)


def test_reset_kills_everything_but_the_supervisor(sb: corral.Sandbox) -> None:
    p = sb.start("sleep 100", keep_background=True)
    assert sb.reset() >= 1
    assert p.wait(timeout=30).end_cause is corral.EndCause.CANCELED
    assert sb.run("echo alive").stdout == "alive\n"
    assert sb.remove() is True
    assert sb.remove() is False


def test_the_image_asked_for(worker: Client) -> None:
    with worker.create(image="corral-debian:latest") as sb:
        assert "debian" in sb.run("cat /etc/os-release").stdout.lower()


def test_no_worker_named_means_the_local_worker_corral_starts(tmp_path: Path) -> None:
    # A program as a user writes it, with no worker anywhere in sight.
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent("""
        import corral
        with corral.Sandbox.create() as sb:
            print(sb.run("echo from the local worker").stdout, end="")
            print(sb.worker)
            # Found again by the address it gave (its token is beside it).
            again = corral.Sandbox.connect(sb.id, worker=sb.worker)
            print(again.run("echo found again").stdout, end="")
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_") or k == "CORRAL_BIN"}
    env["CORRAL_BIN"] = str(BIN_DIR / "corral")
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    said, url, again = out.stdout.splitlines()
    assert said == "from the local worker"
    assert again == "found again"
    sock = tmp_path / "state" / "corral" / "embedded" / "worker.sock"
    assert url == f"unix://{sock}"
    # Left running for the next program (it exits when idle), as with corral.
    token = tmp_path / "state" / "corral" / "embedded" / "token"
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    subprocess.run(["pkill", "-f", f"local-worker --state-dir {sock.parent}"], check=False)


def test_each_command_frees_its_watch_at_once(own_worker: Callable[..., Worker]) -> None:
    # Four watchers a sandbox at most: two hundred commands in a row, and
    # processes read and dropped half-way, never run out of them.
    w = own_worker("--max-watchers-per-sandbox", "4")
    with w.create() as sb:
        for i in range(200):
            assert sb.run(f"echo {i}").stdout == f"{i}\n"
        for _ in range(20):
            p = sb.start("echo a; sleep 0.01; echo b")
            it = p.stdout
            assert next(it) == b"a\n"
            it.close()
            assert p.wait().ok


def test_the_sync_and_async_faces_in_one_program_leave_no_noise(
    worker: Client, tmp_path: Path
) -> None:
    script = tmp_path / "both.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, corral
        W, T = {worker.url!r}, {str(worker.token_file)!r}
        s = corral.Sandbox.create(worker=W, token_file=T)
        s.run("true")
        async def main():
            sb = await corral.AsyncSandbox.connect(s.id, W, token_file=T)
            for _ in range(30):
                await sb.run("true")
        for _ in range(3):
            asyncio.run(main())
        s.run("true")
        s.remove()
        print("done")
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    assert out.stderr == "", out.stderr


def test_loosening_is_the_workers_to_allow(worker: Client) -> None:
    # This worker allows none of it: each refusal names its flag.
    asks: list[tuple[dict[str, Any], str]] = [
        ({"root": True}, "--allow-root"),
        ({"writable_rootfs": True}, "--allow-writable-rootfs"),
        ({"network": "bridge"}, "--allow-network"),
    ]
    for ask, flag in asks:
        with pytest.raises(corral.PolicyDenied) as e:
            worker.create(**ask)
        assert e.value.flag == flag
    with pytest.raises(corral.InvalidArgument):
        worker.create(network="wide open")


def test_a_worker_that_allows_root_and_a_writable_root(own_worker: Callable[..., Worker]) -> None:
    w = own_worker("--allow-root", "--allow-writable-rootfs")
    with w.create(root=True, writable_rootfs=True) as sb:
        r = sb.run("id -u; mkdir -p /logs/x && echo ok > /logs/x/f && cat /logs/x/f")
        assert r.stdout == "0\nok\n", r

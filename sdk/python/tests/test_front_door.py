"""The SDK through a front door (``corral serve --tenants DIR``) with nothing
but ``CORRAL_URL`` and ``CORRAL_API_KEY``: the same calls as against a
worker, each tenant's sandboxes its own, a key that reads refused with
``PermissionDenied``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import BIN_DIR, Worker, free_port

import corral


class FrontDoor:
    def __init__(self, root: Path, worker: Worker) -> None:
        self.tenants = root / "tenants"
        self.tenants.mkdir()
        # Made before it starts: it reads them then (a key made later takes
        # effect within a second).
        self.acme = self.key("acme", "run")
        self.bolt = self.key("bolt", "run")
        self.auditor = self.key("acme", "read")
        self.admin("quota", "set", "--tenant", "bolt", "sandboxes=1")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(root / "serve.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(BIN_DIR / "corral"),
                "--worker",
                worker.url,
                "--token-file",
                str(worker.token_file),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--serve-state-dir",
                str(root / "serve-state"),
                "--sessions-dir",
                str(root / "sessions"),
                "--tenants",
                str(self.tenants),
            ],
            stdout=log,
            stderr=log,
            env={
                k: v
                for k, v in os.environ.items()
                if k not in ("CORRAL_WORKER", "CORRAL_TOKEN_FILE", "CORRAL_URL", "CORRAL_API_KEY")
            },
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"corral serve exited: {(root / 'serve.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("corral serve did not listen within 30 s")

    def admin(self, *args: str) -> bytes:
        out = subprocess.run(
            [str(BIN_DIR / "corral"), "admin", "--tenants", str(self.tenants), *args],
            check=True,
            capture_output=True,
        )
        return out.stdout

    def key(self, tenant: str, scope: str) -> str:
        out = self.admin("key", "create", "--tenant", tenant, "--scope", scope, "--json")
        key: str = json.loads(out)["key"]
        return key

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def door(tmp_path: Path, own_worker: Callable[..., Worker]) -> Iterator[FrontDoor]:
    d = FrontDoor(tmp_path, own_worker())
    yield d
    d.stop()


def as_key(monkeypatch: pytest.MonkeyPatch, door: FrontDoor, key: str) -> None:
    for var in ("CORRAL_WORKER", "CORRAL_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CORRAL_URL", door.url)
    monkeypatch.setenv("CORRAL_API_KEY", key)


def test_a_tenant_works_through_the_front_door_with_its_key_alone(
    door: FrontDoor, monkeypatch: pytest.MonkeyPatch
) -> None:
    acme, bolt, auditor = door.acme, door.bolt, door.auditor
    as_key(monkeypatch, door, acme)
    with corral.Sandbox.create() as sb:
        r = sb.run("echo hello; python3 -c 'print(6*7)'")
        assert r.exit_code == 0, r
        assert r.stdout == "hello\n42\n"
        sb.files.write("notes/a.txt", "from acme\n")
        assert sb.files.read("notes/a.txt") == b"from acme\n"
        assert [e.name for e in sb.files.list("notes")] == ["a.txt"]
        assert [s.id for s in corral.list_sandboxes()] == [sb.id]

        # Another tenant: it is not there.
        as_key(monkeypatch, door, bolt)
        assert corral.list_sandboxes() == []
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect(sb.id).run("true")

        # An auditor of acme's: it lists, and runs nothing.
        as_key(monkeypatch, door, auditor)
        assert [s.id for s in corral.list_sandboxes()] == [sb.id]
        with pytest.raises(corral.PermissionDenied):
            corral.Sandbox.connect(sb.id).run("true")

        # A key that is not one: refused as such.
        as_key(monkeypatch, door, "corral_0123456789ab_" + "0" * 64)
        with pytest.raises(corral.Unauthenticated):
            corral.list_sandboxes()
        as_key(monkeypatch, door, acme)


def test_the_async_face_through_the_front_door(
    door: FrontDoor, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_key(monkeypatch, door, door.acme)

    async def main() -> str:
        sb = await corral.AsyncSandbox.create()
        try:
            r = await sb.run("echo async")
            return r.stdout
        finally:
            await sb.remove()

    assert asyncio.run(main()) == "async\n"


def test_a_quota_refusal_says_which_quota_its_limit_and_its_use(
    door: FrontDoor, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_key(monkeypatch, door, door.bolt)
    with corral.Sandbox.create(), pytest.raises(corral.QuotaExceeded) as refused:
        corral.Sandbox.create()
    e = refused.value
    assert (e.quota, e.limit, e.used) == ("sandboxes", 1, 1)
    assert isinstance(e, corral.ResourceExhausted)

"""The SDK through a front door (``corral serve --tenants DIR``) with nothing
but ``CORRAL_URL`` and ``CORRAL_API_KEY``: the same calls as against a
worker, each tenant's sandboxes its own, a key that reads refused with
``PermissionDenied``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import FrontDoor, Worker

import corral


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

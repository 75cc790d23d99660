"""Volumes from Python, on a worker and through a front door: what one
sandbox wrote is read by the next; one writer at a time, readers beside it;
a volume in use is kept; a missing one is refused by reason."""

from __future__ import annotations

import secrets

import pytest
from conftest import Client

import corral


def test_a_volume_keeps_what_one_sandbox_wrote_for_the_next(worker: Client) -> None:
    at = {"worker": worker.url, "token_file": str(worker.token_file)}
    name = "v" + secrets.token_hex(4)
    v = corral.create_volume(name, size="16m", **at)
    assert (v.name, v.size_bytes, v.writer, v.readers) == (name, 16 << 20, None, ())
    # The same again is the same volume; another size is a conflict.
    assert corral.create_volume(name, size=16 << 20, **at).name == name
    with pytest.raises(corral.Conflict):
        corral.create_volume(name, size="32m", **at)
    try:
        with worker.create(volumes={"/data": name}) as sb:
            assert sb.run("echo kept > /data/f && df -k /data | tail -1").ok
            with pytest.raises(corral.Conflict) as e:
                worker.create(volumes={"/data": name})
            assert e.value.reason == "volume_in_use"
            with worker.create(volumes={"/seen": f"{name}:ro"}) as reader:
                assert reader.run("cat /seen/f").stdout == "kept\n"
                wrote = reader.run("touch /seen/x")
                assert not wrote.ok and "Read-only" in wrote.stderr, wrote
                listed_all = corral.list_volumes(worker.url, **_tf(at))
                (listed,) = [x for x in listed_all if x.name == name]
                assert listed.writer == sb.id and listed.readers == (reader.id,)
                assert listed.used_bytes > 0
            with pytest.raises(corral.Conflict) as e:
                corral.delete_volume(name, **at)
            assert e.value.reason == "volume_in_use"
        with worker.create(volumes={"/w": name}) as sb:
            r = sb.run("cat /w/f; echo more >> /w/f; cat /w/f")
            assert r.stdout == "kept\nkept\nmore\n", r
        with pytest.raises(corral.InvalidArgument) as missing:
            worker.create(volumes={"/data": "nothing-here"})
        assert missing.value.reason == "no_such_volume"
        with pytest.raises(corral.InvalidArgument):
            worker.create(volumes={"/proc/x": name})
    finally:
        assert corral.delete_volume(name, **at)
    assert not any(x.name == name for x in corral.list_volumes(worker.url, **_tf(at)))
    assert not corral.delete_volume(name, **at)


def _tf(at: dict[str, str]) -> dict[str, str]:
    return {"token_file": at["token_file"]}


def test_a_sandbox_saved_as_a_template_starts_the_next_with_its_workspace(
    worker: Client,
) -> None:
    name = "saved-" + secrets.token_hex(4)
    with worker.create() as sb:
        assert sb.run("mkdir -p d && echo kept > d/f").ok
        image = sb.snapshot(name)
        assert image.startswith("corral-snapshot:")
    with worker.create(template=name) as sb:
        r = sb.run("cat d/f; echo more >> d/f && cat d/f")
        assert r.stdout == "kept\nkept\nmore\n", r

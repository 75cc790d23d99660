"""sb.files: read, write, list, and trees in and out as corral cp moves them."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Worker

import corral
from corral import EntryType


def test_write_read_and_list_with_modes(sb: corral.Sandbox) -> None:
    sb.run("mkdir -p notes")
    assert sb.files.write("notes/a.txt", "alpha", mode=0o600) == 5
    sb.files.write("notes/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.files.read("notes/a.txt") == b"alpha"
    assert sb.run("./notes/run.sh").stdout == "ran\n"
    sb.run("mkdir notes/sub; ln -s a.txt notes/link")
    entries = {e.name: e for e in sb.files.list("notes")}
    assert set(entries) == {"a.txt", "run.sh", "sub", "link"}
    assert entries["a.txt"].mode == 0o600 and entries["a.txt"].size == 5
    assert entries["a.txt"].type is EntryType.FILE
    assert entries["run.sh"].mode == 0o755
    assert entries["sub"].type is EntryType.DIRECTORY
    assert entries["link"].type is EntryType.SYMLINK


def test_big_files_go_both_ways_whole(sb: corral.Sandbox) -> None:
    data = os.urandom(20 << 20)
    sb.files.write("/tmp/big.bin", data)
    assert sb.files.read("/tmp/big.bin") == data
    assert sb.run("wc -c < /tmp/big.bin").stdout.strip() == str(len(data))


def test_file_errors_are_typed(sb: corral.Sandbox) -> None:
    with pytest.raises(corral.FileError) as e:
        sb.files.read("no-such-file")
    assert e.value.kind == "not_found" and e.value.code == "NOT_FOUND"
    assert not corral.errors.is_transient(e.value)
    with pytest.raises(corral.FileError) as e:
        sb.files.read("/etc/passwd")
    assert e.value.kind == "outside_sandbox_roots" and e.value.code == "PERMISSION_DENIED"
    sb.run("mkfifo fifo")
    with pytest.raises(corral.FileError) as e:
        sb.files.read("fifo")
    assert e.value.kind == "not_regular" and e.value.code == "FAILED_PRECONDITION"
    with pytest.raises(corral.FileError) as e:
        sb.files.list("no-such-dir")
    assert e.value.kind == "not_found" and "sh:" not in str(e.value), e.value
    sb.files.write("plain.txt", "x")
    with pytest.raises(corral.FileError, match=r"plain\.txt: not a directory$"):
        sb.files.list("plain.txt")


def test_ten_thousand_files_up_and_down(sb: corral.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    for d in range(100):
        sub = src / f"d{d:03}"
        sub.mkdir(parents=True)
        for f in range(100):
            (sub / f"f{f:03}.txt").write_text(f"{d}/{f}\n")
    (src / "d000" / "tool").write_text("#!/bin/sh\n")
    (src / "d000" / "tool").chmod(0o755)
    sent = sb.files.upload(src, "/workspace")
    assert sent > 10_000 * 512
    assert sb.run("find proj -type f | wc -l").stdout.strip() == "10001"
    assert sb.run("cat proj/d042/f007.txt").stdout == "42/7\n"
    assert sb.run("stat -c %a proj/d000/tool").stdout.strip() == "755"

    out = tmp_path / "out"
    out.mkdir()
    moved = sb.files.download("proj", out)
    assert moved.entries == 10_001 + 101
    assert (out / "proj" / "d099" / "f099.txt").read_text() == "99/99\n"
    assert len(list((out / "proj").rglob("*.txt"))) == 10_000
    # Into a new name, as cp does when the destination does not exist.
    sb.files.download("proj/d001/f002.txt", tmp_path / "renamed.txt")
    assert (tmp_path / "renamed.txt").read_text() == "1/2\n"


def test_what_comes_out_is_held_to_corral_cps_rules(sb: corral.Sandbox, tmp_path: Path) -> None:
    sb.run(
        "mkdir -p t/.git/hooks && echo x > t/plain && chmod 4777 t/plain && "
        "ln -s /etc/passwd t/out && mkfifo t/pipe && "
        "echo '[core] fsmonitor = evil' > t/.git/config && echo evil > t/.git/hooks/post-checkout"
    )
    sb.run("mkdir t/private && chmod 700 t/private && echo s > t/private/secret")
    dest = tmp_path / "d"
    dest.mkdir()
    moved = sb.files.download("t", dest)
    # A private directory stays private.
    assert stat.S_IMODE((dest / "t" / "private").stat().st_mode) == 0o700
    plain = (dest / "t" / "plain").stat()
    assert not plain.st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert stat.S_IMODE(plain.st_mode) & 0o022 == 0
    # A link is made, never followed; a FIFO and git's configuration are left out.
    assert os.readlink(dest / "t" / "out") == "/etc/passwd"
    assert not (dest / "t" / "pipe").exists()
    assert not (dest / "t" / ".git" / "config").exists()
    assert not (dest / "t" / ".git" / "hooks" / "post-checkout").exists()
    # Each said: git's configuration and hooks here, the FIFO by the sandbox.
    assert moved.left_out == 4, moved.notes
    assert any("pipe" in n and n.startswith("in the sandbox") for n in moved.notes), moved.notes


def test_upload_drops_set_id_bits_and_keeps_links_in(sb: corral.Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "s"
    src.mkdir()
    (src / "suid").write_text("x")
    (src / "suid").chmod(0o4755)
    (src / "rel").symlink_to("suid")
    os.mkfifo(src / "pipe")
    sb.files.upload(src, "/tmp")
    assert sb.run("stat -c %a /tmp/s/suid").stdout.strip() == "755"
    assert sb.run("readlink /tmp/s/rel").stdout.strip() == "suid"
    # A FIFO holds nothing to copy: left out, never an empty file.
    assert sb.run("ls /tmp/s").stdout.split() == ["rel", "suid"]
    with pytest.raises(corral.TransferError):
        sb.files.upload(tmp_path / "missing", "/tmp")


def test_a_read_is_bounded_and_a_file_over_it_is_a_typed_error(sb: corral.Sandbox) -> None:
    sb.run("head -c 3000000 /dev/zero > three-mb; truncate -s 2G sparse")
    assert len(sb.files.read("three-mb")) == 3_000_000
    with pytest.raises(corral.ResourceExhausted) as e:
        sb.files.read("three-mb", max_bytes=1 << 20)
    assert e.value.reason == "file_too_large" and "max_bytes=1048576" in str(e.value)
    # A sparse file of 2 GiB, at the default bound: refused, not taken into memory.
    with pytest.raises(corral.ResourceExhausted):
        sb.files.read("sparse")
    with pytest.raises(corral.ResourceExhausted):
        sb.files.read_text("three-mb", max_bytes=10)
    assert len(sb.files.read("three-mb", max_bytes=None)) == 3_000_000
    with pytest.raises(corral.InvalidArgument):
        sb.files.read("three-mb", max_bytes=-1)
    # The sandbox goes on (the read was stopped, nothing left running).
    assert sb.run("echo fine").stdout == "fine\n"


def test_a_listing_naming_more_than_one_component_is_refused_as_forged() -> None:
    from corral._core import _parse_listing

    good = b"81a4 5 1700000000\nnotes.txt\x00"
    assert [e.name for e in _parse_listing("d", good)] == ["notes.txt"]
    # What a process tracing the listing's shell could make it write.
    for forged in ["../../../../tmp/x", "a/b", "..", ".", ""]:
        data = good + b"81a4 5 1700000000\n" + forged.encode() + b"\x00"
        with pytest.raises(corral.FileError, match="forged listing"):
            _parse_listing("d", data)


def test_a_listing_is_made_by_no_program_of_the_sandbox(
    own_worker: Callable[..., Worker],
) -> None:
    """The sandbox's own `sh`, replaced by one that lies, changes nothing:
    the worker's helper lists, not a shell of the sandbox's."""
    w = own_worker("--allow-root", "--allow-writable-rootfs")
    with w.create(root=True, writable_rootfs=True) as sb:
        sb.files.write("real.txt", b"hello")
        sb.files.write("/tmp/forger", b"#!/bin/dash\nprintf '81a4 1 1\\nforged.txt\\0'\n")
        assert sb.run("cp /tmp/forger /usr/local/bin/sh && chmod 755 /usr/local/bin/sh").ok
        # A shell the listing would run now lies.
        r = sb.run(["sh", "-c", "true"])
        assert r.stdout == "81a4 1 1\nforged.txt\x00", r
        names = [e.name for e in sb.files.list(".")]
        assert names == ["real.txt"], names

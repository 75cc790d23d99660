"""What comes out of a sandbox is hostile: archives a sandbox could make its
archive helper emit, unpacked as download() unpacks them. Nothing lands
outside the destination, nothing left out comes back, no link is followed."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

import corral
from corral import _tar

DIR, SYM, LNK, FIFO, CHR = (
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CHRTYPE,
)


def tar(*members: dict[str, Any], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as t:
        for m in members:
            m = dict(m)
            data = m.pop("data", b"")
            ti = tarfile.TarInfo(m.pop("name"))
            ti.mode = 0o755 if m.get("type") == DIR else 0o644
            for k, v in m.items():
                setattr(ti, k, v)
            ti.size = len(data) if ti.isreg() else 0
            t.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return b.getvalue()


@pytest.fixture
def room(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_text("original\n")
    os.utime(tmp_path / "outside" / "victim", (1e9, 1e9))
    (tmp_path / "dest").mkdir()
    return tmp_path


def unpack(data: bytes, remote: str, local: Path) -> _tar.Moved:
    top = _tar.archive_name(remote)
    if local.is_dir():
        return _tar.unpack(io.BytesIO(data), local, top, None)
    return _tar.unpack(io.BytesIO(data), local.parent, top, local.name)


def untouched(room: Path) -> None:
    assert sorted(p.name for p in (room / "outside").iterdir()) == ["victim"]
    assert (room / "outside" / "victim").read_text() == "original\n"
    assert (room / "outside" / "victim").stat().st_mtime == 1e9


@pytest.mark.parametrize(
    "members",
    [
        [dict(name="/top", type=DIR)],
        [dict(name="top", type=DIR), dict(name="top/../../outside/victim", data=b"x")],
        [dict(name="top", type=DIR), dict(name="./top/../../y", data=b"x")],
        # Through a link the archive made.
        [
            dict(name="top", type=DIR),
            dict(name="top/l", type=SYM, linkname="../../outside"),
            dict(name="top/l/victim", data=b"x"),
        ],
        [
            dict(name="top", type=DIR),
            dict(name="top/up", type=SYM, linkname=".."),
            dict(name="top/up/outside/new", data=b"x"),
        ],
        # Hard links out of the tree, or to what is no file of it.
        [dict(name="top", type=DIR), dict(name="top/h", type=LNK, linkname="/etc/passwd")],
        [dict(name="top", type=DIR), dict(name="top/h", type=LNK, linkname="../outside/victim")],
        [
            dict(name="top", type=DIR),
            dict(name="top/s", type=SYM, linkname="../../outside/victim"),
            dict(name="top/h", type=LNK, linkname="top/s"),
            dict(name="top/h", data=b"x"),
        ],
        # More than the one file, or another tree.
        [dict(name="top", data=b"a"), dict(name="top/more", data=b"b")],
        [dict(name="top", type=DIR), dict(name="other/x", data=b"b")],
        [dict(name="evil", type=DIR), dict(name="evil/x", data=b"x")],
        [dict(name="top/a/b/c", data=b"x")],
        # A directory swapped for a link to outside before its attributes are set.
        [
            dict(name="top", type=DIR),
            dict(name="top/real", type=DIR),
            dict(name="top/s", type=SYM, linkname="real"),
            dict(name="top/s", type=DIR, mtime=1.7e9),
            dict(name="top/s", type=SYM, linkname="../../outside/victim"),
        ],
    ],
)
def test_nothing_lands_outside(room: Path, members: list[dict[str, Any]]) -> None:
    for local in (room / "dest", room / "dest" / "new-name"):
        with pytest.raises(corral.TransferError):
            unpack(tar(*members), "top", local)
        untouched(room)


def test_a_path_past_path_max_is_no_way_out(room: Path) -> None:
    # Where realpath() stops resolving, tarfile's own check does too.
    dest = room / "dest"
    steps = "abcdefghijklmnop"
    comp = "d" * ((os.pathconf("/", "PC_PATH_MAX") - len(str(dest / "top")) - 1) // 17)
    m: list[dict[str, Any]] = [dict(name="top", type=DIR)]
    path, short = "top", ""
    for c in steps:
        m += [
            dict(name=f"{path}/{comp}", type=DIR),
            dict(name=f"{path}/{c}", type=SYM, linkname=comp),
        ]
        path += "/" + comp
        short += c + "/"
    m += [
        dict(name=f"top/{short}{'l' * 254}", type=SYM, linkname="/".join([".."] * 16)),
        dict(name="top/escape", type=SYM, linkname=f"{short}{'l' * 254}/../../outside"),
        dict(name="top/h", type=LNK, linkname="top/escape/victim"),
        dict(name="top/h", data=b"OVERWRITTEN\n"),
        dict(name="top/escape/new", data=b"NEW\n"),
    ]
    with pytest.raises(corral.TransferError):
        unpack(tar(*m), "top", dest)
    untouched(room)


def test_what_is_left_out_never_comes_back(room: Path) -> None:
    dest = room / "dest"
    moved = unpack(
        tar(
            dict(name="top", type=DIR),
            dict(name="top/p", type=FIFO),
            dict(name="top/d", type=CHR, devmajor=1, devminor=3, mode=0o6666),
            dict(name="top/dev", type=SYM, linkname="d"),
            dict(name="top/.git", type=DIR),
            dict(name="top/.git/hooks", type=DIR, mode=0o7777),
            dict(name="top/.git/hooks/post-checkout", data=b"#!/bin/sh\nevil\n", mode=0o755),
            dict(name="top/.git/config", data=b"[core]\nfsmonitor = evil\n"),
            dict(name="top/.git/modules/sub/config", data=b"evil"),
            dict(name="top/.git/worktrees/w/commondir", data=b"evil"),
            dict(name="top/.GIT/config", data=b"evil"),
            dict(name="top/.git/HOOKS/pre-commit", data=b"evil"),
            dict(name="top/sub/.git", data=b"gitdir: /elsewhere"),
            dict(name="top/.git/HEAD", data=b"ref: refs/heads/main\n"),
        ),
        "top",
        dest,
    )
    on_disk = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    # Nothing of what was left out, not even the directories above it.
    assert on_disk == ["top", "top/.git", "top/.git/HEAD", "top/dev"], on_disk
    assert os.path.islink(dest / "top" / "dev")
    assert moved.left_out == 10, moved.notes
    # Counted as made: what is on disk, nothing left out.
    assert moved.entries == 4
    # A link the system cannot make is an error, not a way to get the entry
    # some other way.
    with pytest.raises(corral.TransferError):
        unpack(
            tar(
                dict(name="top", type=DIR),
                dict(name="top/d", type=CHR),
                dict(name="top/dev", type=SYM, linkname="./" * 2100 + "d"),
            ),
            "top",
            room / "dest" / "l",
        )
    assert not (room / "dest" / "l").exists() or not (room / "dest" / "l" / "dev").exists()
    # A hard link to a left-out entry is refused, never a way to get it.
    with pytest.raises(corral.TransferError):
        unpack(
            tar(
                dict(name="top", type=DIR),
                dict(name="top/p", type=FIFO),
                dict(name="top/fifo", type=LNK, linkname="top/p"),
            ),
            "top",
            room / "dest" / "n",
        )
    # Renamed to .git: its configuration is still git's.
    (room / "clone").mkdir()
    unpack(
        tar(
            dict(name="repo.git", type=DIR),
            dict(name="repo.git/config", data=b"evil"),
            dict(name="repo.git/hooks/x", data=b"evil"),
        ),
        "repo.git",
        room / "clone" / ".git",
    )
    assert list((room / "clone" / ".git").iterdir()) == []


def test_modes_are_bounded_and_files_whole(room: Path) -> None:
    dest = room / "dest"
    unpack(
        tar(
            dict(name="top", type=DIR, mode=0o7777),
            dict(name="top/suid", data=b"x", mode=0o6777),
            dict(name="top/locked", type=DIR, mode=0o000),
            dict(name="top/deep/er/file", data=b"y"),
            dict(name="top/hard", type=LNK, linkname="top/suid"),
        ),
        "top",
        dest,
    )
    mask = _tar._umask() | 0o022
    assert stat.S_IMODE((dest / "top").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((dest / "top" / "suid").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((dest / "top" / "locked").stat().st_mode) == 0
    assert stat.S_IMODE((dest / "top" / "deep").stat().st_mode) == 0o777 & ~mask
    assert (dest / "top" / "hard").stat().st_ino == (dest / "top" / "suid").stat().st_ino
    assert not list(dest.rglob(".corral-part.*"))
    (dest / "top" / "locked").chmod(0o755)


def test_cut_empty_and_bloated_archives_are_refused(room: Path) -> None:
    dest = room / "dest"
    whole = tar(dict(name="top", type=DIR), dict(name="top/big", data=b"z" * 100_000))
    with pytest.raises((corral.TransferError, tarfile.TarError)):
        unpack(whole[:5000], "top", dest)
    # A file cut short leaves nothing of itself.
    assert not (dest / "top" / "big").exists()
    assert not list(dest.rglob(".corral-part.*"))
    with pytest.raises(corral.TransferError, match="empty"):
        unpack(tar(), "top", room / "dest" / "e")
    with pytest.raises(corral.TransferError, match="PAX header"):
        unpack(
            tar(dict(name="top", type=DIR), dict(name="top/" + "n" * (2 << 20), data=b"")),
            "top",
            room / "dest" / "p",
        )
    with pytest.raises(corral.TransferError, match="after the archive"):
        unpack(tar(dict(name="top", data=b"x")) + b"\1" * (2 << 20), "top", room / "dest" / "t")

"""Files and trees in and out of a sandbox as tar streams, placed as
``corral cp`` places them and held to the rules it keeps.

Packing and unpacking run on a thread; the archive moves through a small
bounded queue in pieces of at most 1 MiB, so memory stays bounded whatever
the size. What comes out of a sandbox is hostile: one tree, named as the
path asked for (a file is one file), nothing outside the destination, no
link leading out of it, no set-id bit, modes no wider than 0755/0644 under
the local umask, no FIFO or device, no git configuration or hooks, at most
so many entries and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import tarfile
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, cast

from corral._proto import worker_pb2 as pb
from corral.errors import ConfigError, CorralError, TransferError
from corral.types import result_of

if TYPE_CHECKING:
    from corral._core import AsyncSandbox

CHUNK = 1 << 20
QUEUED = 4
#: As corral cp's limits on what comes out.
MAX_ENTRIES = 1_000_000
MAX_BYTES = 64 << 30
MAX_NOTES = 20
_GIT_LEFT_OUT = {("config",), ("config.worktree",), ("commondir",), ("info", "attributes")}


@dataclass
class Moved:
    """What a download brought: archive bytes, entries made, and a note per
    entry left out (at most 20; ``left_out`` counts them all)."""

    bytes: int = 0
    entries: int = 0
    notes: list[str] = field(default_factory=list)
    left_out: int = 0


def archive_name(remote: str) -> str | None:
    """The name the sandbox gives an archive of ``remote``: its last
    component (a relative path is under /workspace); None for /."""
    p = posixpath.normpath(posixpath.join("/workspace", remote))
    return None if p == "/" else posixpath.basename(p)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class _Rules:
    """The filter every entry of a download passes (tarfile's extraction
    filter protocol), after tarfile's own ``data`` rules."""

    def __init__(self, top: str | None, rename: str | None, moved: Moved) -> None:
        self.top = top
        self.rename = rename
        self.moved = moved
        self.mask = _umask() | 0o022
        self.tree: tuple[str, bool] | None = None
        self.data_bytes = 0

    def _note(self, text: str) -> None:
        self.moved.left_out += 1
        if len(self.moved.notes) < MAX_NOTES:
            self.moved.notes.append(text)

    def _parts(self, name: str) -> tuple[str, ...]:
        p = PurePosixPath(name)
        parts = tuple(x for x in p.parts if x not in (".", ""))
        if p.is_absolute() or not parts or ".." in parts:
            raise TransferError(f"{name}: a name outside the destination: the archive is refused")
        return parts

    def _renamed(self, parts: tuple[str, ...]) -> str:
        if self.rename is not None:
            parts = (self.rename, *parts[1:])
        return "/".join(parts)

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        parts = self._parts(member.name)
        first = parts[0]
        if self.tree is None:
            if self.top is not None and self.rename is None and first != self.top:
                raise TransferError(
                    f"{member.name}: not under {self.top}, the name asked for: "
                    "the archive is refused"
                )
            self.tree = (first, member.isdir())
        else:
            top, is_dir = self.tree
            if not is_dir:
                raise TransferError(
                    f"{member.name}: more than the one file asked for: the archive is refused"
                )
            if first != top:
                raise TransferError(
                    f"{member.name}: not under {top}, the tree asked for: the archive is refused"
                )
        self.moved.entries += 1
        if self.moved.entries > MAX_ENTRIES:
            raise TransferError(f"the archive holds more than {MAX_ENTRIES} entries")
        shown = "/".join(parts)
        if member.ischr() or member.isblk() or member.isfifo():
            self._note(f"{shown}: a special file, left out")
            return None
        if ".git" in parts[:-1]:
            at = parts.index(".git")
            below = parts[at + 1 :]
            if below in _GIT_LEFT_OUT or (below and below[0] == "hooks"):
                self._note(f"{shown}: git configuration, left out")
                return None
        if parts[-1] == ".git" and not member.isdir():
            self._note(f"{shown}: a .git file pointing elsewhere, left out")
            return None
        if member.isfile():
            self.data_bytes += member.size
            if self.data_bytes > MAX_BYTES:
                raise TransferError(f"the archive holds more than {MAX_BYTES} bytes of file data")
        changes: dict[str, Any] = {"name": self._renamed(parts)}
        if member.islnk():
            target = self._parts(member.linkname)
            if self.tree is None or target[0] != self.tree[0]:
                raise TransferError(
                    f"{shown}: a hard link to a file outside the tree: the archive is refused"
                )
            changes["linkname"] = self._renamed(target)
        member = member.replace(**changes, deep=False)
        try:
            if member.issym():
                # A link may point anywhere (it is never followed here: every
                # later entry is checked against where it really lands).
                out = tarfile.tar_filter(member, dest)
                # Never chowned here, whoever runs this.
                nobody: dict[str, Any] = {"uid": None, "gid": None, "uname": None, "gname": None}
                out = out.replace(**nobody, deep=False)
            else:
                out = tarfile.data_filter(member, dest)
        except tarfile.FilterError as e:
            raise TransferError(f"{shown}: {e}: the archive is refused") from e
        if out.mode is not None and not out.issym():
            out = out.replace(mode=out.mode & ~self.mask & 0o7777, deep=False)
        return out


class _Pipe:
    """Bytes between the event loop and a thread, a few pieces at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUED)
        self.buf = bytearray()
        self.closed = threading.Event()

    # The thread's side, writing.
    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= CHUNK:
            self._put(bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]
        return len(data)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self.buf:
            self._put(bytes(self.buf))
            self.buf.clear()
        self._put(None)

    def _put(self, piece: bytes | None) -> None:
        if self.closed.is_set():
            raise TransferError("the transfer was stopped")
        asyncio.run_coroutine_threadsafe(self.queue.put(piece), self.loop).result()

    # The thread's side, reading.
    def read(self, n: int = -1) -> bytes:
        while not self.buf:
            piece = asyncio.run_coroutine_threadsafe(self.queue.get(), self.loop).result()
            if piece is None:
                self.closed.set()
                return b""
            self.buf += piece
        if n < 0:
            n = len(self.buf)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _pack(src: Path, pipe: _Pipe) -> None:
    def strip(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if ti.ischr() or ti.isblk():
            return None
        return ti.replace(mode=ti.mode & 0o1777, deep=False)

    with tarfile.open(fileobj=cast(IO[bytes], pipe), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.add(str(src), arcname=src.name or ".", recursive=True, filter=strip)
    pipe.finish()


async def upload(sb: AsyncSandbox, src: Path, remote: str) -> int:
    if not os.path.lexists(src):
        raise TransferError(f"{src}: no such file or directory")
    loop = asyncio.get_running_loop()
    pipe = _Pipe(loop)
    sent = 0
    failure: list[BaseException] = []

    def pack() -> None:
        try:
            _pack(src, pipe)
        except BaseException as e:  # said to the sender, which stops
            failure.append(e)
            if not pipe.closed.is_set():
                asyncio.run_coroutine_threadsafe(pipe.queue.put(None), loop)

    packer = loop.run_in_executor(None, pack)
    op_id = uuid.uuid4().hex

    async def requests() -> AsyncIterator[pb.UploadRequest]:
        nonlocal sent
        yield pb.UploadRequest(sandbox_id=sb.id, operation_id=op_id, path=remote)
        while True:
            piece = await pipe.queue.get()
            if piece is None:
                break
            sent += len(piece)
            yield pb.UploadRequest(data=piece)
        if failure:
            # Never an eof after a cut archive: the worker cancels it.
            raise TransferError(f"{src}: {failure[0]}")
        yield pb.UploadRequest(eof=True)

    try:
        op = await sb.worker.upload(requests())
    except CorralError:
        if failure:
            raise TransferError(f"{src}: {failure[0]}") from None
        raise
    finally:
        pipe.closed.set()
        # Unblock a packer waiting on a full queue.
        while not pipe.queue.empty():
            pipe.queue.get_nowait()
        await packer
    r = result_of(op.result)
    if not r.ok:
        raise TransferError(f"in the sandbox: {r.stderr.strip() or r.reason or r.end_cause.value}")
    return sent


async def download(sb: AsyncSandbox, remote: str, local: Path) -> Moved:
    if not hasattr(tarfile, "data_filter"):
        raise ConfigError(
            "downloads need a Python whose tarfile has extraction filters "
            "(3.10.12, 3.11.4, 3.12 or later)"
        )
    top = archive_name(remote)
    if local.is_dir():
        base, rename = local, None
    else:
        base, rename = local.parent if str(local.parent) else Path("."), local.name
        if not base.is_dir():
            raise TransferError(f"{base}: no such directory")
        if top is None:
            raise TransferError(f"{local}: the sandbox's root goes into a directory")
    loop = asyncio.get_running_loop()
    pipe = _Pipe(loop)
    moved = Moved()
    rules = _Rules(top, rename, moved)

    def unpack() -> None:
        with tarfile.open(fileobj=cast(IO[bytes], pipe), mode="r|") as tar:
            tar.extractall(str(base), filter=rules)
        # Whatever follows the archive's end (there should be nothing).
        while pipe.read(CHUNK):
            pass

    unpacker = loop.run_in_executor(None, unpack)
    req = pb.DownloadRequest(
        sandbox_id=sb.id, operation_id=uuid.uuid4().hex, archive=pb.ArchiveSpec(path=remote)
    )
    finished: pb.Operation | None = None

    async def pump() -> None:
        nonlocal finished
        async for m in sb.worker.download(req):
            if m.data:
                moved.bytes += len(m.data)
                if not pipe.closed.is_set():
                    await pipe.queue.put(bytes(m.data))
            if m.HasField("finished"):
                finished = m.finished
        if not pipe.closed.is_set():
            await pipe.queue.put(None)

    def sandbox_failure() -> TransferError | None:
        if finished is None:
            return None
        r = result_of(finished.result)
        if r.ok:
            return None
        return TransferError(f"in the sandbox: {r.stderr.strip() or r.reason or r.end_cause.value}")

    pumping = asyncio.ensure_future(pump())
    done, _ = await asyncio.wait({pumping, unpacker}, return_when=asyncio.FIRST_EXCEPTION)
    if unpacker in done and unpacker.exception() is not None:
        err = unpacker.exception()
        assert err is not None
        pipe.closed.set()
        while not pipe.queue.empty():
            pipe.queue.get_nowait()
        if isinstance(err, CorralError):
            # What came broke the rules: nothing more of it is wanted.
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)
            raise err
        # A broken or empty archive: the sandbox's side may say why.
        with contextlib.suppress(asyncio.TimeoutError, CorralError):
            await asyncio.wait_for(pumping, 10)
        raise sandbox_failure() or TransferError(f"{remote}: {err}") from err
    if pumping in done and pumping.exception() is not None:
        # The unpacking thread hears an end, then the worker's error is said.
        pipe.closed.set()
        await pipe.queue.put(None)
        await asyncio.gather(unpacker, return_exceptions=True)
        err2 = pumping.exception()
        assert err2 is not None
        raise err2
    await asyncio.gather(pumping, unpacker)
    if finished is None:
        raise TransferError(f"{remote}: the download ended without its result")
    failed = sandbox_failure()
    if failed is not None:
        raise failed
    return moved


async def get_archive(sb: AsyncSandbox, remote: str, contents: bool) -> bytes:
    """The sandbox's own tar stream of ``remote`` (its contents, as entries
    named ./..., with ``contents``), whole, unpacked by nobody."""
    req = pb.DownloadRequest(
        sandbox_id=sb.id,
        operation_id=uuid.uuid4().hex,
        archive=pb.ArchiveSpec(path=remote, contents=contents),
    )
    parts: list[bytes] = []
    finished: pb.Operation | None = None
    async for m in sb.worker.download(req):
        if m.data:
            parts.append(bytes(m.data))
        if m.HasField("finished"):
            finished = m.finished
    if finished is None:
        raise TransferError(f"{remote}: the download ended without its result")
    r = result_of(finished.result)
    if not r.ok:
        raise TransferError(f"in the sandbox: {r.stderr.strip() or r.reason or r.end_cause.value}")
    return b"".join(parts)


async def put_archive(sb: AsyncSandbox, data: bytes, remote: str) -> None:
    """A tar stream unpacked by the sandbox into ``remote`` (a directory), or
    as ``remote``, under the rules the sandbox keeps for what comes in."""
    op_id = uuid.uuid4().hex

    async def requests() -> AsyncIterator[pb.UploadRequest]:
        yield pb.UploadRequest(sandbox_id=sb.id, operation_id=op_id, path=remote)
        for i in range(0, len(data), CHUNK):
            yield pb.UploadRequest(data=data[i : i + CHUNK])
        yield pb.UploadRequest(eof=True)

    op = await sb.worker.upload(requests())
    r = result_of(op.result)
    if not r.ok:
        raise TransferError(f"in the sandbox: {r.stderr.strip() or r.reason or r.end_cause.value}")

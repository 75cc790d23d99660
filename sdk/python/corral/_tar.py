"""Files and trees in and out of a sandbox as tar streams, placed as
``corral cp`` places them and held to the rules it keeps.

Packing and unpacking run on a thread; the archive moves through a small
bounded queue in pieces of at most 1 MiB, so memory stays bounded whatever
the size. What comes out of a sandbox is hostile: one tree, named as the
path asked for (a file is one file), nothing outside the destination, links
made as they are but never followed (one leading out is written, not
used: a tool run on the tree later may follow it), no set-id bit, modes no
wider than 0755/0644 under the local umask, no FIFO or device, no git
configuration or hooks, at most so many entries and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import stat
import tarfile
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol, cast

from corral import _rpc
from corral._proto import worker_pb2 as pb
from corral.errors import CorralError, TransferError
from corral.types import result_of


class SandboxRef(Protocol):
    """What moving files needs of a sandbox: its id and its worker."""

    @property
    def id(self) -> str: ...

    @property
    def worker(self) -> _rpc.Worker: ...


CHUNK = 1 << 20
QUEUED = 4
#: As corral cp's limits on what comes out.
MAX_ENTRIES = 1_000_000
MAX_BYTES = 8 << 30
MAX_NOTES = 20
#: Largest long-name or PAX header taken.
MAX_HEADER = 1 << 20
MAX_TRAILING = 1 << 20


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


class _BoundedTarInfo(tarfile.TarInfo):
    """A header whose long-name or PAX records are read only up to a bound
    (tarfile reads them whole, before any rule can look)."""

    def _proc_gnulong(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_HEADER:
            raise TransferError(f"a long-name header of {self.size} bytes: the archive is refused")
        return super()._proc_gnulong(tar)  # type: ignore[misc, no-any-return]

    def _proc_pax(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_HEADER:
            raise TransferError(f"a PAX header of {self.size} bytes: the archive is refused")
        return super()._proc_pax(tar)  # type: ignore[misc, no-any-return]


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _git_left_out(parts: tuple[str, ...], is_dir: bool) -> bool:
    """Git's configuration, hooks and pointers anywhere under a ``.git``
    (compared as a case-insensitive file system would)."""
    norm = [p.rstrip(". ").casefold() for p in parts]
    if norm[-1] == ".git" and not is_dir:
        return True
    for i, comp in enumerate(norm[:-1]):
        if comp not in (".git", "git~1"):
            continue
        below = norm[i + 1 :]
        if "hooks" in below:
            return True
        if below[-1] in ("config", "config.worktree", "commondir", "gitdir"):
            return True
        if below[-2:] == ["info", "attributes"]:
            return True
    return False


class Unpacker:
    """Unpacks a hostile tar stream under ``base`` by the rules of what comes
    out of a sandbox. Every path is walked from ``base`` one component at a
    time by directory descriptors, never through a link (``O_NOFOLLOW``): no
    entry can reach outside, whatever links the archive made. A file is
    written under a hidden name and named only once whole; a hard link may
    only name a file this archive wrote."""

    def __init__(self, base: Path, top: str | None, rename: str | None, moved: Moved) -> None:
        self.base = base
        self.top = top
        self.rename = rename
        self.moved = moved
        self.mask = _umask() | 0o022
        self.tree: tuple[str, bool] | None = None
        self.data_bytes = 0
        #: Entries read, made or left out (bounded).
        self.read = 0
        self.files: set[tuple[str, ...]] = set()
        self.dirs: list[tuple[tuple[str, ...], int, float]] = []
        self.made: set[tuple[str, ...]] = set()

    def _note(self, text: str) -> None:
        self.moved.left_out += 1
        if len(self.moved.notes) < MAX_NOTES:
            self.moved.notes.append(text)

    @staticmethod
    def _parts(name: str) -> tuple[str, ...]:
        p = PurePosixPath(name)
        parts = tuple(x for x in p.parts if x not in (".", ""))
        if p.is_absolute() or not parts or ".." in parts or any("\0" in x for x in parts):
            raise TransferError(f"{name!r}: a name outside the destination: the archive is refused")
        return parts

    def _walk(self, parts: tuple[str, ...], create: bool) -> int:
        """A descriptor of the directory ``parts`` under base, reached
        without following any link; made (0700 until the end) if missing."""
        fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, comp in enumerate(parts):
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(comp, 0o700, dir_fd=fd)
                    self.made.add(parts[: i + 1])
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise TransferError(
                        f"{'/'.join(parts[: i + 1])}: not a directory of this archive "
                        f"(a link or a file): the archive is refused"
                    ) from e
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _clear(dfd: int, name: str, shown: str) -> None:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise TransferError(f"{shown}: would replace a directory: the archive is refused")
        os.unlink(name, dir_fd=dfd)

    def entry(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        try:
            self._entry(tar, m)
        except OSError as e:
            raise TransferError(f"{m.name}: {e.strerror or e}") from e

    def _entry(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = self._parts(m.name)
        first = parts[0]
        if self.tree is None:
            if self.top is not None and first != self.top:
                raise TransferError(
                    f"{m.name}: not under {self.top}, the name asked for: the archive is refused"
                )
            if len(parts) != 1:
                raise TransferError(f"{m.name}: the archive does not start with its top entry")
            self.tree = (first, m.isdir())
        else:
            top, is_dir = self.tree
            if not is_dir:
                raise TransferError(
                    f"{m.name}: more than the one file asked for: the archive is refused"
                )
            if first != top:
                raise TransferError(
                    f"{m.name}: not under {top}, the tree asked for: the archive is refused"
                )
        self.read += 1
        if self.read > MAX_ENTRIES:
            raise TransferError(f"the archive holds more than {MAX_ENTRIES} entries")
        if self.rename is not None:
            parts = (self.rename, *parts[1:])
        shown = "/".join(parts)
        if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
            self._note(f"{shown}: a special file, left out")
            return
        if _git_left_out(parts, m.isdir()):
            self._note(f"{shown}: git configuration, left out")
            return
        # Made (or a failure below ends the download).
        self.moved.entries += 1
        mode = m.mode & 0o777 & ~self.mask
        dfd = self._walk(parts[:-1], create=True)
        name = parts[-1]
        try:
            if m.isdir():
                try:
                    st = os.lstat(name, dir_fd=dfd)
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(name, dir_fd=dfd)
                        os.mkdir(name, 0o700, dir_fd=dfd)
                except FileNotFoundError:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                self.dirs.append((parts, mode, float(m.mtime)))
            elif m.isreg():
                self.data_bytes += m.size
                if self.data_bytes > MAX_BYTES:
                    raise TransferError(
                        f"the archive holds more than {MAX_BYTES >> 30} GiB of file data"
                    )
                self._clear(dfd, name, shown)
                self._write(tar, m, dfd, name, mode)
                self.files.add(parts)
            elif m.issym():
                # Made, never followed: every later entry is walked without
                # following links.
                self._clear(dfd, name, shown)
                os.symlink(m.linkname, name, dir_fd=dfd)
            else:
                target = self._parts(m.linkname)
                if self.rename is not None:
                    target = (self.rename, *target[1:])
                if target not in self.files:
                    raise TransferError(
                        f"{shown}: a hard link to {m.linkname!r}, no file of this archive: "
                        "the archive is refused"
                    )
                tfd = self._walk(target[:-1], create=False)
                try:
                    self._clear(dfd, name, shown)
                    os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
                finally:
                    os.close(tfd)
                self.files.add(parts)
        finally:
            os.close(dfd)

    def _write(
        self, tar: tarfile.TarFile, m: tarfile.TarInfo, dfd: int, name: str, mode: int
    ) -> None:
        src = tar.extractfile(m)
        assert src is not None
        part = f".corral-part.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = os.open(
            part,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dfd,
        )
        try:
            with os.fdopen(fd, "wb", closefd=True) as out:
                while piece := src.read(CHUNK):
                    out.write(piece)
                out.flush()
                os.fchmod(out.fileno(), mode)
                os.utime(out.fileno(), (float(m.mtime), float(m.mtime)))
            # Named only once whole: a cut archive leaves no part of a file.
            os.rename(part, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part, dir_fd=dfd)
            raise

    def finish(self) -> None:
        if self.tree is None:
            raise TransferError("the archive is empty")
        # Directories last, deepest first, each reached without links: its
        # mode and time are set on what this archive made, nothing else.
        wanted = {p: (mode, mtime) for p, mode, mtime in self.dirs}
        for p in self.made:
            wanted.setdefault(p, (0o777 & ~self.mask, -1.0))
        for p in sorted(wanted, key=len, reverse=True):
            mode, mtime = wanted[p]
            try:
                fd = self._walk(p, create=False)
            except (OSError, TransferError):
                continue
            try:
                os.fchmod(fd, mode)
                if mtime >= 0:
                    os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)


class _Tally:
    """An archive's input, counted: the bytes read, and how many zero bytes
    end them (tarfile stops, without a word, where its input ends between
    two entries, or mid-header)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.total = 0
        self.zeros = 0

    def read(self, n: int = -1) -> bytes:
        piece = self.inner.read(n)
        stripped = piece.rstrip(b"\0")
        if stripped:
            self.zeros = len(piece) - len(stripped)
        else:
            self.zeros += len(piece)
        self.total += len(piece)
        return piece


def unpack(fileobj: IO[bytes], base: Path, top: str | None, rename: str | None) -> Moved:
    """What :func:`download` does with the archive it gets, on a thread."""
    moved = Moved()
    u = Unpacker(base, top, rename, moved)
    tally = _Tally(fileobj)
    with tarfile.open(fileobj=cast(IO[bytes], tally), mode="r|", tarinfo=_BoundedTarInfo) as tar:
        while (m := tar.next()) is not None:
            u.entry(tar, m)
            # Stream mode keeps every header read: not here.
            cast(Any, tar).members.clear()
        end = tar.offset
    # What follows the archive's end is padding, or someone's junk: bounded.
    while tally.read(CHUNK):
        if tally.total - end > MAX_TRAILING + 1024:
            raise TransferError("more than 1 MiB after the archive's end: the archive is refused")
    # Whole only with its two zero blocks, and nothing but zeros after them.
    after = tally.total - end
    if after < 1024:
        raise TransferError(
            "the archive ends without its end-of-archive blocks: it was cut short, and is refused"
        )
    if tally.zeros < after:
        raise TransferError("the archive has data after its end: it is refused")
    u.finish()
    moved.bytes = tally.total
    return moved


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
        # Devices and FIFOs hold nothing to copy (a FIFO became an empty
        # file in the sandbox), as `corral cp` leaves them out.
        if ti.ischr() or ti.isblk() or ti.isfifo():
            return None
        return ti.replace(mode=ti.mode & 0o1777, deep=False)

    with tarfile.open(fileobj=cast(IO[bytes], pipe), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.add(str(src), arcname=src.name or ".", recursive=True, filter=strip)
    pipe.finish()


async def upload(sb: SandboxRef, src: Path, remote: str) -> int:
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


async def download(sb: SandboxRef, remote: str, local: Path) -> Moved:
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
    received = 0
    result: list[Moved] = []

    def unpacking() -> None:
        result.append(unpack(cast(IO[bytes], pipe), base, top, rename))

    unpacker = loop.run_in_executor(None, unpacking)
    req = pb.DownloadRequest(
        sandbox_id=sb.id, operation_id=uuid.uuid4().hex, archive=pb.ArchiveSpec(path=remote)
    )
    finished: pb.Operation | None = None

    async def pump() -> None:
        nonlocal finished
        async for m in sb.worker.download(req):
            if m.data:
                nonlocal received
                received += len(m.data)
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
    moved = result[0]
    wrote = finished.result.stdout.total_bytes
    if received != wrote:
        raise TransferError(
            f"{remote}: the archive came short: {received} of the {wrote} bytes "
            "written in the sandbox"
        )
    if moved.bytes != received:
        raise TransferError(
            f"{remote}: unpacking read {moved.bytes} of the {received} bytes received"
        )
    # What the sandbox's side left out (special files, say), in its words.
    said = result_of(finished.result).stderr
    for line in said.splitlines():
        if line.strip():
            moved.left_out += 1
            if len(moved.notes) < MAX_NOTES:
                moved.notes.append(f"in the sandbox: {line.strip()}")
    return moved


async def get_archive(sb: SandboxRef, remote: str, contents: bool) -> bytes:
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


async def put_archive(sb: SandboxRef, data: bytes, remote: str) -> None:
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

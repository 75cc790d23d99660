"""The one async core: sandboxes, their processes and files, on grpc.aio.

Everything here is idempotent by id (a sandbox or operation id is chosen by
the client), so a call cut by a worker restart or a network blink is made
again with the same ids and nothing runs twice; a watch goes on from the
sequence number of the last event it got, so no output is lost or repeated.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import os
import random
import shlex
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from corral import _connect, _rpc, _tar, _volumes
from corral._proto import worker_pb2 as pb
from corral._units import parse_size
from corral.errors import (
    CorralError,
    FileError,
    InvalidArgument,
    ResourceExhausted,
    SandboxNotFound,
    WorkerUnavailable,
    is_transient,
)
from corral.types import (
    EndCause,
    EntryType,
    FileEntry,
    OutputChunk,
    PortAccess,
    PortExposure,
    Result,
    SandboxInfo,
    SandboxList,
    SandboxStats,
    WorkerInfo,
    exposure_of,
    result_of,
    sandbox_info_of,
    stats_of,
    worker_info_of,
)

#: How long a worker may stay unreachable before a call gives up on it.
PATIENCE_S = 60.0
#: Largest piece of input sent in one call (the worker's limit).
CHUNK = 1 << 20
#: The worker's longest timeout of a command.
MAX_TIMEOUT_MS = 24 * 60 * 60 * 1000
#: Largest write sent whole, in one operation.
MAX_FILE = 8 << 20
#: Most bytes ``files.read`` takes into memory unless told otherwise.
MAX_READ = 64 << 20
#: Workers probed before a placement; beyond, two at random.
PROBE_ALL_UP_TO = 8
PROBE_TIMEOUT_S = 1.0
ATTEMPTS = 3
#: How long each of several workers is given to list its sandboxes (the
#: CLI's wait too).
ASK_TIMEOUT_S = 5.0

Command = str | Sequence[str]
OnOutput = Callable[[bytes], Awaitable[None] | None]


def _new_id() -> str:
    return uuid.uuid4().hex


def _ms(seconds: float | None, what: str) -> int:
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidArgument(f"{what}: {seconds!r} is not a number of seconds")
    if seconds < 0:
        raise InvalidArgument(f"{what}: {seconds} is negative")
    return max(1, round(seconds * 1000)) if seconds > 0 else 0


def _strings(values: Sequence[str] | None, what: str) -> list[str]:
    """A list of strings, as given; a lone string is refused, not split
    into its characters (``egress="pypi.org"`` means ``["pypi.org"]``, and
    a policy must never be guessed)."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)):
        raise InvalidArgument(f"{what}: a list of strings, not one string ({[values]!r}?)")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise InvalidArgument(f"{what}: {v!r} is not a string")
    return out


def _str_map(values: Mapping[str, str] | None, what: str) -> dict[str, str]:
    """A mapping of strings to strings, checked here (not by the protobuf
    runtime's own TypeError)."""
    out = dict(values or {})
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"{what}: {k!r}={v!r}: names and values are strings")
    return out


def _positive(v: float | None, what: str, *, whole: bool = False) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (whole and not isinstance(v, int)):
        raise InvalidArgument(f"{what}: {v!r} is not a {'whole ' if whole else ''}number")
    if v <= 0:
        raise InvalidArgument(f"{what}: {v} is not positive")


def _network(network: str | None) -> pb.NetworkMode:
    modes = {
        None: pb.NETWORK_MODE_UNSPECIFIED,
        "none": pb.NETWORK_MODE_NONE,
        "bridge": pb.NETWORK_MODE_BRIDGE,
    }
    if network not in modes:
        raise InvalidArgument(f"network {network!r}: none or bridge")
    return modes[network]


def _data(data: object, what: str) -> bytes:
    """Bytes to send: a str (as UTF-8) or bytes-like. Nothing else: ``bytes(5)``
    would be five NUL bytes, ``bytes(True)`` one."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise InvalidArgument(f"{what}: bytes or str, not {type(data).__name__}")


#: Bytes to send: a str is sent as UTF-8.
Data = bytes | bytearray | memoryview | str

#: A path in a sandbox: a string, or a path object (``PurePosixPath``).
SandboxPath = str | os.PathLike[str]


def _path(p: object, what: str) -> str:
    if isinstance(p, os.PathLike):
        p = os.fspath(p)
    if not isinstance(p, str):
        raise InvalidArgument(f"{what}: a path (str), not {type(p).__name__}")
    return p


def _command(cmd: Command) -> str:
    """A string runs as it is under ``sh -c``; a list is an argv, quoted so
    that the shell runs exactly it."""
    if isinstance(cmd, str):
        return cmd
    if isinstance(cmd, (bytes, bytearray)) or not isinstance(cmd, Sequence):
        raise InvalidArgument(f"a command is a str or a list of str, not {type(cmd).__name__}")
    args = list(cmd)
    if not args or not all(isinstance(a, str) for a in args):
        raise InvalidArgument("a command list needs at least one string, and only strings")
    return shlex.join(args)


async def _call_back(cb: OnOutput | None, data: bytes) -> None:
    if cb is None:
        return
    out = cb(data)
    if inspect.isawaitable(out):
        await out


def _file_error(r: pb.OperationResult, path: str) -> FileError | None:
    if r.outcome.WhichOneof("kind") != "file_error":
        return None
    kind = pb.FileErrorKind.Name(r.outcome.file_error.kind).removeprefix("FILE_ERROR_KIND_")
    said = r.outcome.file_error.message
    # The worker's words name the path already, most of the time.
    message = said if said.startswith(path) else f"{path}: {said}"
    return FileError(message, kind=kind.lower())


class AsyncProcess:
    """A command running in a sandbox (see :meth:`AsyncSandbox.start`).

    ``stdout`` and ``stderr`` are iterators of bytes; each follows the
    command's output from its start (or from ``after``) on its own, so a
    stream nobody reads holds nothing back. ``seq`` is the place, in the
    sandbox's event stream, of the last output any iterator gave:
    ``AsyncProcess.attach(sb, id, after=seq)`` goes on right after it.
    """

    def __init__(self, sandbox: AsyncSandbox, op_id: str, after: int = 0) -> None:
        self.sandbox = sandbox
        self.id = op_id
        self.after = after
        self.seq = after
        #: Events from this process's start on that the worker's journal
        #: dropped before they could be read (output lost to a reader that
        #: came too late; another process's events dropped meanwhile count
        #: too, as the journal does not say whose they were).
        self.missed = 0
        #: The sequence number of its first event, once known.
        self._first_seq = 0
        self._input = 0
        self._result: Result | None = None
        self._raw = pb.OperationResult()

    @classmethod
    async def attach(
        cls, sandbox: AsyncSandbox, process_id: str, after: int | None = None
    ) -> AsyncProcess:
        """Picks a process up again (after this client died, or its worker
        restarted): its output from ``after`` (an :class:`OutputChunk`'s
        seq), or from its start."""
        op = await sandbox._ask(
            "GetOperation",
            pb.GetOperationRequest(sandbox_id=sandbox.id, operation_id=process_id),
            pb.Operation,
        )
        p = cls(sandbox, process_id, after or 0)
        p._first_seq = op.first_seq
        p._input = op.input_bytes
        if op.status == pb.OPERATION_STATUS_FINISHED:
            p._result = result_of(op.result)
        return p

    async def _events(
        self, after: int, opened: AsyncGenerator[pb.SandboxEvent, None] | None = None
    ) -> AsyncGenerator[pb.SandboxEvent, None]:
        """The operation's events after ``after``, to its end, across
        dropped watches and worker restarts; first those of ``opened`` (a
        stream of them already open, from its first event)."""
        sb = self.sandbox
        loop = asyncio.get_running_loop()
        last = after
        gone_since: float | None = None
        pause = 0.05
        while True:
            try:
                if opened is not None:
                    stream, opened = opened, None
                else:
                    req = pb.WatchSandboxRequest(
                        sandbox_id=sb.id, after_seq=last, operation_id=self.id
                    )
                    stream = sb.worker.watch(req)
                try:
                    async for ev in stream:
                        gone_since = None
                        last = max(last, ev.seq)
                        kind = ev.WhichOneof("kind")
                        if kind == "gap":
                            # Only what was dropped from its start on can
                            # be its own.
                            if not self._first_seq:
                                self._first_seq = (
                                    await sb._ask(
                                        "GetOperation",
                                        pb.GetOperationRequest(
                                            sandbox_id=sb.id, operation_id=self.id
                                        ),
                                        pb.Operation,
                                    )
                                ).first_seq
                            # Still none: it had no event yet, so none of
                            # its own was dropped.
                            lo = max(ev.gap.from_seq, self._first_seq)
                            if self._first_seq and ev.gap.to_seq >= lo:
                                self.missed += ev.gap.to_seq - lo + 1
                            continue
                        yield ev
                        if kind == "finished":
                            return
                finally:
                    # Ended now, not when collected: the worker's watcher
                    # slot is freed at once.
                    await stream.aclose()
                # The stream ended without the operation's end: ask again.
            except CorralError as e:
                if not is_transient(e):
                    raise
                now = loop.time()
                gone_since = gone_since if gone_since is not None else now
                if now - gone_since > sb.patience:
                    raise WorkerUnavailable(
                        f"{sb.worker.url}: unreachable for {sb.patience:.0f} s "
                        f"following {self.id}: {e.message}",
                        code=e.code,
                        reason=e.reason,
                    ) from e
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _follow(
        self,
        on_stdout: OnOutput | None = None,
        on_stderr: OnOutput | None = None,
        on_chunk: Callable[[OutputChunk], Awaitable[None]] | None = None,
        opened: AsyncGenerator[pb.SandboxEvent, None] | None = None,
    ) -> Result:
        events = self._events(self.after, opened)
        try:
            async for ev in events:
                kind = ev.WhichOneof("kind")
                if kind == "output":
                    data = bytes(ev.output.data)
                    if ev.output.stream == pb.OUTPUT_STREAM_STDERR:
                        await _call_back(on_stderr, data)
                        stream = "stderr"
                    else:
                        await _call_back(on_stdout, data)
                        stream = "stdout"
                    self.seq = max(self.seq, ev.seq)
                    if on_chunk is not None:
                        await on_chunk(OutputChunk(ev.seq, stream, data))
                elif kind == "finished":
                    self._raw = ev.finished.result
                    self._result = result_of(ev.finished.result)
                    return self._result
        finally:
            # The watch ends here and now (not when collected), and an
            # opened one never read too.
            await events.aclose()
            if opened is not None:
                await opened.aclose()
        # _events ends only with the operation's end (results are never
        # dropped from the journal) or an error.
        raise AssertionError("an operation's events ended without its result")

    async def events(self) -> AsyncIterator[OutputChunk]:
        """Both streams' output in the order it came, each piece with its seq."""
        events = self._events(self.after)
        try:
            async for ev in events:
                if ev.WhichOneof("kind") != "output":
                    continue
                stream = "stderr" if ev.output.stream == pb.OUTPUT_STREAM_STDERR else "stdout"
                self.seq = max(self.seq, ev.seq)
                yield OutputChunk(ev.seq, stream, bytes(ev.output.data))
        finally:
            await events.aclose()

    async def _only(self, which: int) -> AsyncIterator[bytes]:
        events = self._events(self.after)
        try:
            async for ev in events:
                if ev.WhichOneof("kind") == "output" and ev.output.stream == which:
                    self.seq = max(self.seq, ev.seq)
                    yield bytes(ev.output.data)
        finally:
            await events.aclose()

    @property
    def stdout(self) -> AsyncIterator[bytes]:
        return self._only(pb.OUTPUT_STREAM_STDOUT)

    @property
    def stderr(self) -> AsyncIterator[bytes]:
        return self._only(pb.OUTPUT_STREAM_STDERR)

    async def wait(self, timeout: float | None = None) -> Result:
        """Its result once it ends. With ``timeout`` (seconds), TimeoutError
        when it is still running by then (it goes on)."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
        ):
            raise InvalidArgument(f"timeout {timeout!r}: seconds, 0 or more")
        if self._result is not None:
            return self._result
        if timeout is None:
            return await self._follow()
        try:
            return await asyncio.wait_for(self._follow(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"process {self.id} still runs after {timeout} s") from None

    async def write_stdin(self, data: Data) -> bool:
        """Feeds its stdin (started with ``stdin=True``); False when it takes
        no more input (it ended, or its stdin was closed)."""
        raw = _data(data, "stdin")
        for i in range(0, max(len(raw), 1), CHUNK):
            piece = raw[i : i + CHUNK]
            if not piece:
                break
            if not await self._input_call(piece, eof=False):
                return False
        return True

    async def close_stdin(self) -> None:
        """Ends its stdin (it reads end-of-file)."""
        await self._input_call(b"", eof=True)

    async def _input_call(self, piece: bytes, eof: bool) -> bool:
        sb = self.sandbox
        req = pb.WriteInputRequest(
            sandbox_id=sb.id, operation_id=self.id, offset=self._input, data=piece, eof=eof
        )
        reply = await sb._ask("WriteInput", req, pb.WriteInputResponse)
        if reply.closed:
            return False
        self._input = max(self._input + len(piece), reply.input_bytes)
        return True

    async def signal(self, sig: int) -> bool:
        """Sends ``sig`` (``signal.SIGINT``, ...) to its process group: the
        command and what it started; False when it had ended."""
        if isinstance(sig, bool) or not isinstance(sig, int) or not 0 < sig < 65:
            raise InvalidArgument(f"signal {sig!r}: a signal number such as signal.SIGINT")
        reply = await self.sandbox._ask(
            "SignalOperation",
            pb.SignalOperationRequest(
                sandbox_id=self.sandbox.id, operation_id=self.id, signal=int(sig)
            ),
            pb.SignalOperationResponse,
        )
        return reply.delivered

    async def kill(self) -> bool:
        """Ends it (and every process it started); its result says
        ``canceled``. False when it had ended already."""
        reply = await self.sandbox._ask(
            "CancelOperation",
            pb.CancelOperationRequest(sandbox_id=self.sandbox.id, operation_id=self.id),
            pb.CancelOperationResponse,
        )
        return reply.canceling


def _parse_listing(path: str, data: bytes) -> list[FileEntry]:
    """The entries a listing of ``path`` wrote (a line of mode, size and time,
    then the name and a NUL, each): made in the sandbox, so taken only in the
    form asked for, and a name is one component of a path, nothing more."""
    out: list[FileEntry] = []
    base = path.rstrip("/") or "/"
    at = 0
    # By offset: partitioning what is left would copy it for every entry.
    while at < len(data):
        nl = data.find(b"\n", at)
        if nl < 0:
            nl = len(data)
        nul = data.find(b"\0", nl + 1)
        if nul < 0:
            nul = len(data)
        line, name = data[at:nl], data[nl + 1 : nul]
        at = nul + 1
        # Made by commands in the sandbox: taken only in the form asked.
        try:
            raw_mode, size, mtime = line.split()
            mode, size_n, mtime_f = int(raw_mode, 16), int(size), float(mtime)
        except ValueError:
            raise FileError(
                f"{path}: a listing line {line[:80]!r} is malformed", kind="other"
            ) from None
        kind = {
            0o040000: EntryType.DIRECTORY,
            0o100000: EntryType.FILE,
            0o120000: EntryType.SYMLINK,
        }.get(mode & 0o170000, EntryType.OTHER)
        n = name.decode("utf-8", "surrogateescape")
        # A name is one component: anything else is a forged listing (a
        # process in the sandbox can change what the shell writes).
        if n in ("", ".", "..") or "/" in n:
            raise FileError(
                f"{path}: the listing names {n[:80]!r}, which no directory holds: "
                "a forged listing, refused",
                kind="other",
            )
        out.append(
            FileEntry(
                name=n,
                path=f"{base}/{n}" if base != "/" else f"/{n}",
                type=kind,
                mode=mode & 0o7777,
                size=size_n,
                mtime=mtime_f,
            )
        )
    return sorted(out, key=lambda e: e.name)


class _TooLarge(Exception):
    """A file read over its bound (stops following it)."""


class AsyncPorts:
    """A sandbox's ports, reached from outside through its worker's port
    listener (``corral-worker --ports-listen``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def expose(
        self,
        port: int,
        *,
        access: PortAccess | str = PortAccess.PRIVATE,
        ttl: float | None = None,
        wake_on_request: bool = False,
    ) -> PortExposure:
        """Exposes ``port``: its URL (and, for ``signed`` access, its token).
        ``ttl`` in seconds (default: until revoked; signed: one hour).
        ``wake_on_request``: a request to the port while the sandbox is
        checkpointed restores it. Exposing a port again replaces its
        exposure (earlier tokens no longer hold). Exposures outlive a
        checkpoint and a restart of the worker."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidArgument(f"port: 1 to 65535, not {port!r}")
        kind = {
            PortAccess.PRIVATE: pb.PORT_ACCESS_PRIVATE,
            PortAccess.SIGNED: pb.PORT_ACCESS_SIGNED,
            PortAccess.PUBLIC: pb.PORT_ACCESS_PUBLIC,
        }[PortAccess(access)]
        ttl_ms = 0 if ttl is None else max(1, int(ttl * 1000))
        req = pb.ExposePortRequest(
            sandbox_id=self._sb.id,
            port=port,
            access=kind,
            ttl_ms=ttl_ms,
            wake_on_request=wake_on_request,
        )
        return exposure_of(await self._sb._ask("ExposePort", req, pb.PortExposure))

    async def revoke(self, port: int) -> bool:
        """Ends the exposure of ``port`` (its tokens are refused, its open
        connections cut): whether it was exposed."""
        req = pb.RevokeAccessRequest(sandbox_id=self._sb.id, port=port)
        return (await self._sb._ask("RevokeAccess", req, pb.RevokeAccessResponse)).revoked

    async def list(self) -> builtins.list[PortExposure]:
        """The exposed ports (without tokens)."""
        req = pb.ListExposuresRequest(sandbox_id=self._sb.id)
        resp = await self._sb._ask("ListExposures", req, pb.ListExposuresResponse)
        return [exposure_of(e) for e in resp.exposures]

    async def wait(self, port: int, *, timeout: float = 60.0) -> None:
        """Waits until something listens on ``port`` in the sandbox (a
        server it started); TimeoutError after ``timeout`` seconds."""
        probe = (
            "import socket,sys\n"
            "s=socket.socket();s.settimeout(1)\n"
            f"sys.exit(0 if s.connect_ex(('127.0.0.1',{int(port)}))==0 else 1)"
        )
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            r = await self._sb.run(
                f"python3 -c {shlex.quote(probe)} 2>/dev/null || nc -z 127.0.0.1 {int(port)}",
                timeout=10,
            )
            if r.ok:
                return
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError(f"nothing listened on port {port} within {timeout} s")
            await asyncio.sleep(0.2)


class AsyncFiles:
    """A sandbox's files (paths relative to /workspace, or under /tmp)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(self, path: SandboxPath, *, max_bytes: int | None = MAX_READ) -> bytes:
        """The whole file; FileError when there is none, or it is no regular file.
        A file over ``max_bytes`` (64 MiB unless given; None: no bound) is
        not read into memory: ResourceExhausted (use :meth:`download`)."""
        path = _path(path, "path")
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise InvalidArgument(f"max_bytes {max_bytes!r}: not a number of bytes")
        spec = pb.OperationSpec(read_file=pb.ReadFileSpec(path=path, stream=True))
        p = await self._sb._submit(spec)
        parts: list[bytes] = []
        got = 0

        def take(piece: bytes) -> None:
            nonlocal got
            got += len(piece)
            if max_bytes is not None and got > max_bytes:
                raise _TooLarge
            parts.append(piece)

        try:
            await p._follow(on_stdout=take)
        except _TooLarge:
            parts.clear()
            with contextlib.suppress(CorralError):
                await p.kill()
            raise ResourceExhausted(
                f"{path}: larger than max_bytes={max_bytes}; give a larger max_bytes, "
                "or download it",
                reason="file_too_large",
            ) from None
        err = _file_error(p._raw, path)
        if err is not None:
            raise err
        return b"".join(parts)

    async def read_text(
        self, path: SandboxPath, encoding: str = "utf-8", *, max_bytes: int | None = MAX_READ
    ) -> str:
        return (await self.read(path, max_bytes=max_bytes)).decode(encoding)

    async def write(self, path: SandboxPath, data: Data, mode: int | None = None) -> int:
        """Replaces (or makes) the file; bytes written."""
        path = _path(path, "path")
        raw = _data(data, "data")
        if mode is not None and (
            isinstance(mode, bool) or not isinstance(mode, int) or not 0 < mode <= 0o7777
        ):
            # 0 cannot be asked for: it means "the default" on the wire.
            raise InvalidArgument(f"mode {mode!r}: not a file mode (0o1 to 0o7777)")
        stream = len(raw) > MAX_FILE
        first = raw[:CHUNK] if stream else raw
        spec = pb.OperationSpec(
            write_file=pb.WriteFileSpec(path=path, data=first, mode=mode or 0, stream=stream)
        )
        p = await self._sb._submit(spec)
        if stream:
            # The spec's bytes come first; input offsets count what follows.
            ok = await p.write_stdin(raw[len(first) :])
            if ok:
                await p.close_stdin()
        r = await p._follow()
        err = _file_error(p._raw, path)
        if err is not None:
            raise err
        if r.end_cause is not EndCause.EXITED:
            raise CorralError(f"{path}: the write ended {r.end_cause.value}: {r.reason or ''}")
        return len(raw)

    async def list(self, path: SandboxPath = ".") -> list[FileEntry]:
        """The entries of a directory (not . and ..), by name. Listed by the
        sandbox's supervisor, which its processes cannot trace; the names are
        still the sandbox's data (see :func:`_parse_listing`)."""
        path = _path(path, "path")
        try:
            p = await self._sb._submit(pb.OperationSpec(list_dir=pb.ArchiveSpec(path=path)))
        except InvalidArgument:
            # A worker older than list_dir.
            return await self._list_by_shell(path)
        parts: list[bytes] = []
        got = 0

        def take(piece: bytes) -> None:
            nonlocal got
            got += len(piece)
            if got > MAX_READ:
                raise _TooLarge
            parts.append(piece)

        try:
            await p._follow(on_stdout=take)
        except _TooLarge:
            with contextlib.suppress(CorralError):
                await p.kill()
            raise ResourceExhausted(f"{path}: the listing is over {MAX_READ} bytes") from None
        err = _file_error(p._raw, path)
        if err is not None:
            raise err
        return _parse_listing(path, b"".join(parts))

    def _listing_failed(self, path: str, r: Result) -> None:
        """Raises the FileError a failed listing (its exit status) says."""
        failed = {
            3: ("no such file or directory", "not_found"),
            5: ("not a directory", "other"),
            6: ("permission denied", "permission_denied"),
        }.get(r.exit_code or 0)
        if failed is not None:
            raise FileError(f"{path}: {failed[0]}", kind=failed[1])
        if not r.ok:
            raise FileError(f"{path}: {r.stderr.strip() or r.end_cause.value}", kind="other")

    async def _list_by_shell(self, path: str) -> builtins.list[FileEntry]:
        script = (
            '[ -e "$1" ] || exit 3; [ -d "$1" ] || exit 5; cd -- "$1" 2>/dev/null || exit 6; '
            "for f in * .[!.]* ..?*; do "
            '[ -e "$f" ] || [ -L "$f" ] || continue; '
            "stat -c '%f %s %Y' -- \"$f\" || exit 4; printf '%s\\0' \"$f\"; done"
        )
        r = await self._sb.run(["sh", "-c", script, "sh", path])
        self._listing_failed(path, r)
        if r.omitted_bytes:
            raise ResourceExhausted(f"{path}: the listing is over the worker's output limit")
        return _parse_listing(path, r.stdout_bytes)

    async def upload(self, local: str | Path, remote: SandboxPath = ".") -> int:
        """Copies a local file or tree into the sandbox as ``corral cp`` does:
        into ``remote`` when that is a directory, else as ``remote``.
        Archive bytes sent."""
        return await _tar.upload(self._sb, Path(local), _path(remote, "remote"))

    async def get_archive(self, remote: SandboxPath, *, contents: bool = False) -> bytes:
        """The sandbox's tar stream of ``remote`` as it made it (its entries
        named ./... with ``contents``). Unpacking it is the caller's: what
        comes out of a sandbox is hostile (:meth:`download` applies the rules)."""
        return await _tar.get_archive(self._sb, _path(remote, "remote"), contents)

    async def put_archive(self, remote: SandboxPath, data: bytes) -> None:
        """Unpacks a tar stream into the directory ``remote`` of the sandbox
        (or as ``remote``), by the sandbox's own rules for what comes in."""
        await _tar.put_archive(self._sb, _data(data, "data"), _path(remote, "remote"))

    async def download(self, remote: SandboxPath, local: str | Path) -> _tar.Moved:
        """Copies a sandbox file or tree here as ``corral cp`` does: into
        ``local`` when that is a directory, else as ``local``. What comes out
        of a sandbox is held to the rules ``corral cp`` keeps (one tree of
        the name asked for, no link out, no set-id bit, no special file, no
        git configuration or hooks)."""
        return await _tar.download(self._sb, _path(remote, "remote"), Path(local))


def _shell_spec(
    cmd: Command,
    *,
    cwd: SandboxPath | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    stdin: bool,
    bash: bool,
    keep_background: bool,
    terminal: tuple[int, int] | None,
) -> pb.OperationSpec:
    """A shell operation's spec, its arguments checked (see
    :meth:`AsyncSandbox.start`)."""
    # A timeout of 0 would end the command before it starts: refused,
    # never read as "none".
    _positive(timeout, "timeout")
    if not isinstance(stdin, bool):
        raise InvalidArgument(
            f"stdin {stdin!r}: True opens a pipe for write_stdin (run() takes the bytes)"
        )
    shell = pb.ShellSpec(
        command=_command(cmd),
        workdir=_path(cwd, "cwd") if cwd is not None else "",
        env=_str_map(env, "env"),
        # None: the longest the worker takes (24 h), as corral exec
        # asks: no timeout unless one is given.
        timeout_ms=_ms(timeout, "timeout") or MAX_TIMEOUT_MS,
        use_bash=bash,
        keep_background=keep_background,
        stdin=stdin,
    )
    if terminal is not None:
        if not isinstance(terminal, (tuple, list)) or len(terminal) != 2:
            raise InvalidArgument(f"terminal {terminal!r}: (rows, cols)")
        rows, cols = terminal
        _positive(rows, "terminal rows", whole=True)
        _positive(cols, "terminal columns", whole=True)
        shell.terminal.CopyFrom(pb.TerminalSize(rows=rows, cols=cols))
    return pb.OperationSpec(shell=shell)


class AsyncSandbox:
    """A sandbox on a worker (see :meth:`create` and :meth:`connect`)."""

    def __init__(self, worker: _rpc.Worker, info: pb.Sandbox, owned: bool) -> None:
        self.worker = worker
        self.id = info.id
        self.owned = owned
        self.patience = PATIENCE_S
        self.files = AsyncFiles(self)
        self.ports = AsyncPorts(self)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, worker={self.worker.url!r})"

    @classmethod
    async def create(
        cls,
        image: str | None = None,
        *,
        worker: str | None = None,
        memory: int | str | None = None,
        cpus: float | None = None,
        pids: int | None = None,
        env: Mapping[str, str] | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        runtime: str | None = None,
        workspace_size: int | str | None = None,
        network: str | None = None,
        egress: Sequence[str] | None = None,
        root: bool = False,
        writable_rootfs: bool = False,
        capabilities: Sequence[str] | None = None,
        id: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        template: str | None = None,
        volumes: Mapping[str, str] | None = None,
    ) -> AsyncSandbox:
        """Makes a sandbox: on ``worker`` (an address, a comma-separated list,
        or ``dns:///NAME:PORT``; default ``CORRAL_WORKER``, else the local
        worker), placed on the freest of several. ``ttl`` and
        ``idle_timeout`` are seconds; ``memory`` bytes or a size (``2g``).
        ``egress`` names what the sandbox may reach through its worker's
        proxy (``["pypi.org", "*.pythonhosted.org", "github.com:22"]``; it
        keeps no network of its own), within the worker's
        ``--allow-egress``; ``egress=[]`` gives it the proxy with nothing
        allowed yet (:meth:`set_egress` opens it later). ``network="bridge"``,
        ``root`` (commands as uid 0), ``writable_rootfs`` and
        ``capabilities`` (``CAP_SETUID``, ...) loosen the hardened defaults,
        as far as the worker's policy allows (else :class:`PolicyDenied` naming its flag).
        ``template`` names one of the worker's templates (see
        :class:`corral.Template`): the sandbox runs its image and is handed
        out once its start command runs and its readiness probe holds.
        ``volumes`` mounts volumes (:func:`corral.create_volume`) by path:
        ``{"/data": "NAME"}``, ``"NAME:ro"`` read-only; of several workers,
        the sandbox is made where they live."""
        _positive(cpus, "cpus")
        _positive(pids, "pids", whole=True)
        spec = pb.SandboxSpec(
            image=image or "",
            memory_bytes=parse_size(memory, "memory"),
            cpu_millis=round(cpus * 1000) if cpus else 0,
            pids_limit=pids or 0,
            workspace_bytes=parse_size(workspace_size, "workspace_size"),
            env=_str_map(env, "env"),
            labels=_str_map(labels, "labels"),
            ttl_ms=_ms(ttl, "ttl"),
            idle_timeout_ms=_ms(idle_timeout, "idle_timeout"),
            runtime=runtime or "",
            network=_network(network),
            egress=_strings(egress, "egress"),
            # An empty list, not None: the proxy, nothing allowed yet.
            egress_proxy=egress is not None,
            run_as_root=root,
            writable_rootfs=writable_rootfs,
            add_capabilities=_strings(capabilities, "capabilities"),
            template=template or "",
            volumes=_volumes.mounts(dict(volumes or {})),
        )
        ws = await _rpc.workers(
            _connect.Options.from_env(
                worker,
                token_file=token_file,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls_server_name=tls_server_name,
            )
        )
        ws = await _volumes.having(ws, {m.name for m in spec.volumes})
        req = pb.CreateSandboxRequest(id=id or _new_id(), spec=spec)
        w, made = await _place(ws, req)
        return cls(w, made, owned=True)

    @classmethod
    async def connect(
        cls,
        id: str,
        worker: str | None = None,
        *,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> AsyncSandbox:
        """An existing sandbox, found among the workers (it is not removed
        at the end of a ``with`` block: it is not this object's)."""
        ws = await _rpc.workers(
            _connect.Options.from_env(
                worker,
                token_file=token_file,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                tls_server_name=tls_server_name,
            )
        )
        found = await _find(ws, id)
        return cls(found[0], found[1], owned=False)

    async def _ask(self, name: str, req: object, resp: type[_rpc.Resp]) -> _rpc.Resp:
        return await _rpc.retrying(
            lambda: self.worker.call(name, req, resp), self.patience, is_transient, self.worker
        )

    async def _submit(self, spec: pb.OperationSpec) -> AsyncProcess:
        op_id = _new_id()
        req = pb.SubmitOperationRequest(sandbox_id=self.id, operation_id=op_id, spec=spec)
        op = await self._ask("SubmitOperation", req, pb.Operation)
        p = AsyncProcess(self, op_id)
        p._first_seq = op.first_seq
        return p

    async def start(
        self,
        cmd: Command,
        *,
        cwd: SandboxPath | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bool = False,
        bash: bool = False,
        keep_background: bool = False,
        terminal: tuple[int, int] | None = None,
    ) -> AsyncProcess:
        """Starts a command and returns at once. A string runs under ``sh -c``
        (``bash -c`` with ``bash=True``), never a login shell; a list runs
        as that argv. ``timeout`` (seconds) ends the command (none unless given:
        the worker's cap, 24 h); its stream has none. ``stdin=True`` opens a pipe
        fed by ``write_stdin``. ``terminal=(rows, cols)`` runs it on a
        pseudo-terminal: its input is ``write_stdin``'s (Ctrl-C is ``\x03``),
        all its output comes as stdout."""
        return await self._submit(
            _shell_spec(
                cmd,
                cwd=cwd,
                env=env,
                timeout=timeout,
                stdin=stdin,
                bash=bash,
                keep_background=keep_background,
                terminal=terminal,
            )
        )

    async def _run_op(
        self, spec: pb.OperationSpec
    ) -> tuple[AsyncProcess, AsyncGenerator[pb.SandboxEvent, None] | None]:
        """Submits ``spec`` and opens its watch in one call
        (``RunOperation``): the process, and the stream of its events from
        its first (``None`` from a worker of an earlier release, which
        lacks the call: submitted alone, it is watched as any other)."""
        op_id = _new_id()
        req = pb.SubmitOperationRequest(sandbox_id=self.id, operation_id=op_id, spec=spec)

        async def opened() -> tuple[pb.Operation, AsyncGenerator[pb.RunOperationResponse, None]]:
            stream = self.worker.run(req)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                raise WorkerUnavailable(
                    f"{self.worker.url}: RunOperation ended before it said the operation"
                ) from None
            except BaseException:
                await stream.aclose()
                raise
            if first.WhichOneof("kind") != "submitted":
                await stream.aclose()
                raise CorralError(f"{self.worker.url}: RunOperation said no operation first")
            return first.submitted, stream

        try:
            op, stream = await _rpc.retrying(opened, self.patience, is_transient, self.worker)
        except CorralError as e:
            if e.code != "UNIMPLEMENTED":
                raise
            return await self._submit(spec), None
        p = AsyncProcess(self, op_id)
        p._first_seq = op.first_seq

        async def events() -> AsyncGenerator[pb.SandboxEvent, None]:
            try:
                async for r in stream:
                    if r.WhichOneof("kind") == "event":
                        yield r.event
            finally:
                await stream.aclose()

        return p, events()

    async def run(
        self,
        cmd: Command,
        *,
        cwd: SandboxPath | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: Data | None = None,
        on_stdout: OnOutput | None = None,
        on_stderr: OnOutput | None = None,
        bash: bool = False,
    ) -> Result:
        """Runs a command to its end. A non-zero exit, a signal or a timeout
        is a result, never an exception. ``on_stdout``/``on_stderr`` hear
        every byte as it comes (plain or async functions)."""
        if isinstance(stdin, bool):
            raise InvalidArgument(
                "stdin: the bytes or str to feed it (start(stdin=True) opens a pipe)"
            )
        if stdin is not None:
            stdin = _data(stdin, "stdin")
        spec = _shell_spec(
            cmd,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin is not None,
            bash=bash,
            keep_background=False,
            terminal=None,
        )
        p, opened = await self._run_op(spec)
        try:
            return await self._run_started(p, stdin, on_stdout, on_stderr, opened)
        except BaseException:
            # A callback that raised, a caller that gave up: the command
            # goes with it.
            with contextlib.suppress(Exception):
                await asyncio.shield(p.kill())
            raise

    async def _run_started(
        self,
        p: AsyncProcess,
        stdin: Data | None,
        on_stdout: OnOutput | None,
        on_stderr: OnOutput | None,
        opened: AsyncGenerator[pb.SandboxEvent, None] | None = None,
    ) -> Result:
        if stdin is None:
            return await p._follow(on_stdout, on_stderr, opened=opened)

        async def feed() -> None:
            if await p.write_stdin(stdin):
                await p.close_stdin()

        feeding = asyncio.ensure_future(feed())
        try:
            result = await p._follow(on_stdout, on_stderr, opened=opened)
        finally:
            if not feeding.done():
                feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError, CorralError):
            await feeding
        return result

    async def reset(self) -> int:
        """Kills every process of the sandbox but its supervisor (running
        commands end ``canceled``); processes killed."""
        r = await self._ask(
            "ResetSandbox", pb.ResetSandboxRequest(id=self.id), pb.ResetSandboxResponse
        )
        return r.killed

    async def set_egress(self, rules: Sequence[str]) -> SandboxInfo:
        """Replaces the egress policy of a sandbox made with ``egress`` (an
        empty list too): new connections follow it at once, open ones it no
        longer allows are closed. An empty list allows nothing."""
        s = await self._ask(
            "SetSandboxEgress",
            pb.SetSandboxEgressRequest(id=self.id, rules=_strings(rules, "rules")),
            pb.Sandbox,
        )
        return sandbox_info_of(s, self.worker.url)

    async def checkpoint(self) -> SandboxInfo:
        """Saves a gVisor sandbox's processes and memory on its worker and
        stops it (``checkpointed``: it runs nothing, and calls that need it
        running raise :class:`corral.SandboxCheckpointed`) until
        :meth:`restore`. ``runtime="runsc"`` sandboxes only."""
        s = await self._ask(
            "CheckpointSandbox", pb.CheckpointSandboxRequest(id=self.id), pb.Sandbox
        )
        return sandbox_info_of(s, self.worker.url)

    async def snapshot(self, template: str) -> str:
        """Saves this sandbox as template ``template`` (its image and its
        workspace, not its processes): ``Sandbox.create(template=...)`` makes
        sandboxes that start with that workspace. The image it runs."""
        t = await self._ask(
            "SnapshotSandbox",
            pb.SnapshotSandboxRequest(id=self.id, template=template),
            pb.Template,
        )
        return t.image

    async def restore(self) -> SandboxInfo:
        """Starts a checkpointed sandbox again: its processes go on where
        they stood, its memory as it was."""
        s = await self._ask("RestoreSandbox", pb.RestoreSandboxRequest(id=self.id), pb.Sandbox)
        return sandbox_info_of(s, self.worker.url)

    async def get_host(self, port: int) -> str:
        """The URL of ``port`` (exposed private if it is not yet exposed)."""
        for e in await self.ports.list():
            if e.port == port:
                return e.url
        return (await self.ports.expose(port)).url

    async def wait_for_port(self, port: int, *, timeout: float = 60.0) -> None:
        """Waits until something listens on ``port`` in the sandbox (see
        :meth:`AsyncPorts.wait`); TimeoutError after ``timeout`` seconds."""
        await self.ports.wait(port, timeout=timeout)

    async def stats(self) -> SandboxStats:
        """Memory, CPU and processes now. The memory limit is the working
        memory asked for plus the sizes of ``/workspace`` and ``/tmp``
        (their files count in memory), unless the sandbox was made with
        one limit for both."""
        return stats_of(
            await self._ask(
                "GetSandboxStats", pb.GetSandboxStatsRequest(sandbox_id=self.id), pb.SandboxStats
            )
        )

    async def info(self) -> SandboxInfo:
        s = await self._ask("GetSandbox", pb.GetSandboxRequest(id=self.id), pb.Sandbox)
        return sandbox_info_of(s, self.worker.url)

    async def worker_info(self) -> WorkerInfo:
        return worker_info_of(
            await self._ask("GetWorkerInfo", pb.GetWorkerInfoRequest(), pb.WorkerInfo)
        )

    async def remove(self) -> bool:
        """Removes the sandbox and everything in it; False when it was gone."""
        r = await self._ask(
            "DestroySandbox", pb.DestroySandboxRequest(id=self.id), pb.DestroySandboxResponse
        )
        return r.existed

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.owned:
            await self.remove()


async def _probe(w: _rpc.Worker) -> tuple[_rpc.Worker, pb.WorkerInfo | None]:
    return w, await _rpc.answers(w, PROBE_TIMEOUT_S)


async def _place(
    ws: list[_rpc.Worker], req: pb.CreateSandboxRequest
) -> tuple[_rpc.Worker, pb.Sandbox]:
    """Makes the sandbox on the freest worker: every one probed up to a few,
    else the freer of two at random; a refusal (full, draining) tries the
    next, up to three."""
    if len(ws) == 1:
        w = ws[0]
        made = await _rpc.retrying(
            lambda: w.call("CreateSandbox", req, pb.Sandbox), PATIENCE_S, _create_retry, w
        )
        return w, made
    tried: set[str] = set()
    last: CorralError | None = None
    for _ in range(ATTEMPTS):
        left = [w for w in ws if w.url not in tried]
        if not left:
            break
        pick = left if len(left) <= PROBE_ALL_UP_TO else random.sample(left, 2)
        probed = await asyncio.gather(*(_probe(w) for w in pick))
        able = [
            (w, i)
            for w, i in probed
            if i is not None and not i.draining and i.sandboxes < i.max_sandboxes
        ]
        if not able:
            for w, _ in probed:
                tried.add(w.url)
            continue
        able.sort(key=lambda wi: wi[1].max_sandboxes - wi[1].sandboxes, reverse=True)
        w = able[0][0]
        tried.add(w.url)
        try:
            return w, await w.call("CreateSandbox", req, pb.Sandbox)
        except CorralError as e:
            if e.reason not in ("at_capacity", "draining") and not is_transient(e):
                raise
            last = e
    raise last or WorkerUnavailable(
        "no worker can take it: none answered, or all are full or draining"
    )


def _create_retry(e: CorralError) -> bool:
    # The same id and spec again is the same sandbox: safe to repeat.
    return is_transient(e) and e.reason not in ("draining", "shutting_down")


async def _find(ws: list[_rpc.Worker], id: str) -> tuple[_rpc.Worker, pb.Sandbox]:
    async def ask(w: _rpc.Worker) -> tuple[_rpc.Worker, pb.Sandbox | CorralError]:
        try:
            return w, await w.call("GetSandbox", pb.GetSandboxRequest(id=id), pb.Sandbox)
        except CorralError as e:
            return w, e

    answers = await asyncio.gather(*(ask(w) for w in ws))
    for w, a in answers:
        if isinstance(a, pb.Sandbox):
            return w, a
    errors = [a for _, a in answers if isinstance(a, CorralError)]
    not_found = [e for e in errors if isinstance(e, SandboxNotFound)]
    if len(ws) == 1 or len(not_found) == len(errors):
        raise errors[0]
    raise next(e for e in errors if not isinstance(e, SandboxNotFound))


async def list_sandboxes(
    worker: str | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    token_file: str | None = None,
) -> SandboxList:
    """Every sandbox of the workers named (or of the local worker), oldest
    first; with ``labels``, those that carry all of them. Of several workers,
    those that do not answer within a few seconds are left out and named in
    the list's ``unreachable``; if none answers (or the one named fails), its
    error is raised."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)

    async def ask(w: _rpc.Worker) -> pb.ListSandboxesResponse:
        timeout = None if len(ws) == 1 else ASK_TIMEOUT_S
        return await w.call(
            "ListSandboxes", pb.ListSandboxesRequest(), pb.ListSandboxesResponse, timeout
        )

    answers = await asyncio.gather(*(ask(w) for w in ws), return_exceptions=True)
    out: list[SandboxInfo] = []
    unreachable: dict[str, BaseException] = {}
    for w, r in zip(ws, answers, strict=True):
        if isinstance(r, BaseException):
            if not isinstance(r, Exception):
                raise r
            unreachable[w.url] = r
            continue
        out.extend(
            sandbox_info_of(s, w.url)
            for s in r.sandboxes
            if all(s.spec.labels.get(k) == v for k, v in (labels or {}).items())
        )
    if len(unreachable) == len(ws):
        raise next(iter(unreachable.values()))
    out.sort(key=lambda s: (s.created_at_unix_ms, s.id))
    return SandboxList(out, unreachable)

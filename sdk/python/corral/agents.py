"""An OpenAI Agents SDK sandbox client that runs a ``SandboxAgent``'s work in
Corral sandboxes.

    from agents import RunConfig, Runner
    from agents.sandbox import SandboxAgent, SandboxRunConfig
    from corral.agents import CorralSandboxClient, CorralSandboxClientOptions

    run_config = RunConfig(sandbox=SandboxRunConfig(
        client=CorralSandboxClient(),                      # CORRAL_WORKER, or the local worker
        options=CorralSandboxClientOptions(image="corral-debian:latest"),
    ))

The client makes one Corral sandbox a session; the manifest's environment
is the sandbox's, its root (``/workspace`` by default) the working directory
of every command. ``resume`` reattaches to the same sandbox when it is still
there (after the program that made it crashed, say), else makes a new one
that the SDK hydrates from the session's snapshot. Workspaces persist and
hydrate as tar streams of the root's contents, moved by the sandbox's
supervisor (no tar needed in the image).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import time
import urllib.parse
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    ExposedPortUnavailableError,
    PtySessionNotFoundError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSession, SandboxSessionState
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.session.runtime_helpers import RESOLVE_WORKSPACE_PATH_HELPER
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.workspace_payloads import coerce_write_payload
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, ExposedPortEndpoint, User
from agents.sandbox.util.tar_utils import validate_tarfile
from agents.sandbox.workspace_paths import sandbox_path_str

from corral._core import AsyncProcess, AsyncSandbox
from corral.errors import CorralError, FileError, SandboxLost, SandboxNotFound
from corral.types import EndCause, SandboxState


class CorralSandboxClientOptions(BaseSandboxClientOptions):
    """What a new sandbox is made of (each unset field: the worker's default)."""

    type: Literal["corral"] = "corral"
    image: str | None = None
    memory: str | None = None
    cpus: float | None = None
    pids: int | None = None
    #: The worker removes a sandbox no client has used for this long
    #: (seconds): what a crashed program leaves does not stay for good.
    idle_timeout: float | None = 3600
    ttl: float | None = None
    #: Ports of the sandbox the session may resolve for access from
    #: outside (``resolve_exposed_port``): each exposed with signed access
    #: through the worker's port listener, which must have a wildcard domain
    #: (``corral-worker --ports-domain``) so that a port has a host of its own.
    exposed_ports: tuple[int, ...] = ()


class CorralSandboxSessionState(SandboxSessionState):
    type: Literal["corral"] = "corral"
    sandbox_id: str
    #: The worker's address the sandbox is on (None: the client's default).
    worker: str | None = None
    image: str | None = None
    memory: str | None = None
    cpus: float | None = None
    pids: int | None = None
    idle_timeout: float | None = None
    ttl: float | None = None


#: The window of a PTY process's terminal.
PTY_SIZE = (24, 80)


@dataclass
class _Pty:
    """A process started for the SDK's PTY tools, its output gathered as it
    comes."""

    process: AsyncProcess
    tty: bool
    last_used: float = field(default_factory=time.monotonic)
    output_chunks: deque[bytes] = field(default_factory=deque)
    output_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    output_notify: asyncio.Event = field(default_factory=asyncio.Event)
    output_closed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    pump: asyncio.Task[None] | None = None

    async def follow(self) -> None:
        try:
            async for chunk in self.process.events():
                async with self.output_lock:
                    self.output_chunks.append(chunk.data)
                self.output_notify.set()
            r = await self.process.wait()
            # As a local process's return code: a signal is its negative.
            self.exit_code = (
                -r.signal if r.signal else (r.exit_code if r.exit_code is not None else -1)
            )
        finally:
            if self.exit_code is None:
                self.exit_code = -1
            self.output_closed.set()
            self.output_notify.set()


class CorralSandboxSession(BaseSandboxSession):
    state: CorralSandboxSessionState

    def __init__(self, *, state: CorralSandboxSessionState, sandbox: AsyncSandbox) -> None:
        self.state = state
        self.sandbox = sandbox
        self._ptys: dict[int, _Pty] = {}

    def supports_pty(self) -> bool:
        return True

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        """The port exposed with signed access: its host (the worker's
        ``{port}-{sandbox}.{domain}``), the listener's port, and the token
        as the query a client's first request carries."""

        def unavailable(detail: str, cause: BaseException | None = None) -> Exception:
            return ExposedPortUnavailableError(
                port=port,
                exposed_ports=self.state.exposed_ports,
                reason="backend_unavailable",
                context={"backend": "corral", "detail": detail},
                cause=cause,
            )

        try:
            e = await self.sandbox.ports.expose(port, access="signed")
        except CorralError as err:
            raise unavailable(str(err), err) from err
        url = urllib.parse.urlsplit(e.url)
        if url.path not in ("", "/") or url.hostname is None:
            raise unavailable(
                "the worker routes ports by path (/p/...): start it with --ports-domain "
                "so that each port has a host of its own"
            )
        tls = url.scheme == "https"
        return ExposedPortEndpoint(
            host=url.hostname,
            port=url.port or (443 if tls else 80),
            tls=tls,
            query=f"token={e.token}" if e.token else "",
        )

    async def pty_exec_start(
        self,
        *command: str | Path,
        timeout: float | None = None,
        shell: bool | list[str] = True,
        user: str | User | None = None,
        tty: bool = False,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        argv = [str(c) for c in self._prepare_exec_command(*command, shell=shell, user=user)]
        cwd = self.state.manifest.root if self.state.workspace_root_ready else None
        try:
            p = await self.sandbox.start(
                argv, cwd=cwd, timeout=timeout, terminal=PTY_SIZE if tty else None
            )
        except CorralError as e:
            raise ExecTransportError(command=argv, cause=e, context={"retry_safe": True}) from e
        entry = _Pty(process=p, tty=tty)
        entry.pump = asyncio.ensure_future(entry.follow())
        if len(self._ptys) >= PTY_PROCESSES_MAX:
            meta = [(i, e.last_used, e.output_closed.is_set()) for i, e in self._ptys.items()]
            old = process_id_to_prune_from_meta(meta)
            if old is not None:
                await self._terminate(self._ptys.pop(old))
        pid = allocate_pty_process_id(set(self._ptys))
        self._ptys[pid] = entry
        wait_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(pid, entry, clamp_pty_yield_time_ms(wait_ms), max_output_tokens)

    async def pty_write_stdin(
        self,
        *,
        session_id: int,
        chars: str,
        yield_time_s: float | None = None,
        max_output_tokens: int | None = None,
    ) -> PtyExecUpdate:
        entry = self._ptys.get(session_id)
        if entry is None:
            raise PtySessionNotFoundError(session_id=session_id)
        if chars:
            if not entry.tty:
                raise RuntimeError("stdin is not available for this process")
            with contextlib.suppress(CorralError):
                await entry.process.write_stdin(chars.encode("utf-8"))
            await asyncio.sleep(0.1)
        wait_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        wait_ms = resolve_pty_write_yield_time_ms(yield_time_ms=wait_ms, input_empty=chars == "")
        entry.last_used = time.monotonic()
        return await self._collect(session_id, entry, wait_ms, max_output_tokens)

    async def _collect(
        self, pid: int, entry: _Pty, wait_ms: int, max_output_tokens: int | None
    ) -> PtyExecUpdate:
        output, tokens, closed = await collect_pty_output(
            output_chunks=entry.output_chunks,
            output_lock=entry.output_lock,
            output_notify=entry.output_notify,
            is_done=entry.output_closed.is_set,
            yield_time_ms=wait_ms,
            max_output_tokens=max_output_tokens,
        )
        if closed and entry.exit_code is not None:
            self._ptys.pop(pid, None)
            return PtyExecUpdate(
                process_id=None,
                output=output,
                exit_code=entry.exit_code,
                original_token_count=tokens,
            )
        return PtyExecUpdate(
            process_id=pid, output=output, exit_code=None, original_token_count=tokens
        )

    async def _terminate(self, entry: _Pty) -> None:
        with contextlib.suppress(CorralError):
            await entry.process.kill()
        if entry.pump is not None:
            entry.pump.cancel()
            with contextlib.suppress(BaseException):
                await entry.pump

    async def pty_terminate_all(self) -> None:
        entries, self._ptys = list(self._ptys.values()), {}
        for entry in entries:
            await self._terminate(entry)

    async def _ensure_backend_started(self) -> None:
        root = self.state.manifest.root
        r = await self.sandbox.run(["mkdir", "-p", "--", root])
        if not r.ok:
            raise ExecTransportError(
                command=["mkdir", "-p", root], context={"stderr": r.stderr, "exit": r.exit_code}
            )

    async def _shutdown_backend(self) -> None:
        # The sandbox stays until the client deletes it (or its worker's
        # idle timeout does).
        return None

    async def running(self) -> bool:
        try:
            return (await self.sandbox.info()).state is SandboxState.READY
        except (SandboxNotFound, SandboxLost):
            return False

    def _runtime_helpers(self) -> tuple[Any, ...]:
        return (RESOLVE_WORKSPACE_PATH_HELPER,)

    def _current_runtime_helper_cache_key(self) -> object | None:
        return self.sandbox.id

    async def _validate_path_access(self, path: Path | str, *, for_write: bool = False) -> Path:
        out: Path = await self._validate_remote_path_access(path, for_write=for_write)
        return out

    async def _exec_internal(
        self, *command: str | Path, timeout: float | None = None
    ) -> ExecResult:
        argv = [str(c) for c in command]
        out: list[bytes] = []
        err: list[bytes] = []
        cwd = self.state.manifest.root if self.state.workspace_root_ready else None
        try:
            r = await self.sandbox.run(
                argv, cwd=cwd, timeout=timeout, on_stdout=out.append, on_stderr=err.append
            )
        except CorralError as e:
            raise ExecTransportError(command=argv, cause=e, context={"reason": e.reason}) from e
        if r.end_cause is EndCause.TIMED_OUT:
            raise ExecTimeoutError(command=argv, timeout_s=timeout)
        if r.exit_code is None:
            raise ExecTransportError(
                command=argv,
                context={"end_cause": r.end_cause.value, "reason": r.reason},
                message=f"the command ended {r.end_cause.value}: {r.reason or ''}",
            )
        return ExecResult(stdout=b"".join(out), stderr=b"".join(err), exit_code=r.exit_code)

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            return await _read_as(self, path, user)
        workspace_path = await self._validate_path_access(path)
        try:
            data = await self.sandbox.files.read(sandbox_path_str(workspace_path))
        except FileError as e:
            if e.kind == "not_found":
                raise WorkspaceReadNotFoundError(path=path, cause=e) from e
            raise WorkspaceArchiveReadError(path=path, cause=e, context={"kind": e.kind}) from e
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        payload = coerce_write_payload(path=path, data=data)
        workspace_path = await self._validate_path_access(path, for_write=True)
        body = payload.stream.read()
        target = sandbox_path_str(workspace_path)
        if user is not None:
            # As that user, the bytes on its stdin.
            argv = self._prepare_exec_command(
                "sh",
                "-c",
                'mkdir -p "$(dirname "$1")" && cat > "$1"',
                "sh",
                target,
                shell=False,
                user=user,
            )
            r = await self.sandbox.run([str(a) for a in argv], stdin=body)
            if not r.ok:
                raise WorkspaceArchiveWriteError(path=workspace_path, context={"stderr": r.stderr})
            return
        parent = str(Path(target).parent)
        await self.sandbox.run(["mkdir", "-p", "--", parent])
        try:
            await self.sandbox.files.write(target, body)
        except FileError as e:
            raise WorkspaceArchiveWriteError(path=workspace_path, cause=e) from e

    async def persist_workspace(self) -> io.IOBase:
        root = self.state.manifest.root
        try:
            raw = await self.sandbox.files.get_archive(root, contents=True)
        except CorralError as e:
            raise WorkspaceArchiveReadError(path=Path(root), cause=e) from e
        skip = {p.as_posix().strip("/") for p in self._persist_workspace_skip_relpaths()}
        if not skip:
            return io.BytesIO(raw)
        # Left out: what the SDK says is not the workspace's (mounts,
        # ephemeral entries).
        out = io.BytesIO()
        with (
            tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as src,
            tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as dst,
        ):
            for m in src:
                rel = m.name.removeprefix("./").strip("/")
                if any(rel == s or rel.startswith(s + "/") for s in skip):
                    continue
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        out.seek(0)
        return out

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        root = self.state.manifest.root
        raw = data.read()
        if not isinstance(raw, bytes):
            raise WorkspaceArchiveWriteError(path=Path(root), context={"reason": "not bytes"})
        try:
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:*") as tar:
                validate_tarfile(tar)
        except Exception as e:
            raise WorkspaceArchiveWriteError(path=Path(root), cause=e) from e
        await self.sandbox.run(["mkdir", "-p", "--", root])
        try:
            await self.sandbox.files.put_archive(root, raw)
        except CorralError as e:
            raise WorkspaceArchiveWriteError(path=Path(root), cause=e) from e


async def _read_as(session: CorralSandboxSession, path: Path, user: str | User) -> io.IOBase:
    """A read as another user of the sandbox: through ``cat`` run as them."""
    workspace_path = await session._validate_path_access(path)
    arg = sandbox_path_str(workspace_path)
    res = await session.exec("cat", "--", arg, shell=False, user=user)
    if not res.ok():
        await session._raise_read_error_from_exec(
            path=path,
            workspace_path=workspace_path,
            command=("cat", "--", arg),
            result=res,
            user=user,
        )
    return io.BytesIO(res.stdout)


class CorralSandboxClient(BaseSandboxClient[CorralSandboxClientOptions | None]):
    """Sessions in Corral sandboxes on ``worker`` (an address, a list,
    ``dns:///NAME:PORT``; default ``CORRAL_WORKER``, else the local worker)."""

    backend_id = "corral"
    supports_default_options = True

    def __init__(
        self,
        *,
        worker: str | None = None,
        token_file: str | None = None,
        instrumentation: Instrumentation | None = None,
    ) -> None:
        self.worker = worker
        self.token_file = token_file
        self._instrumentation = instrumentation or Instrumentation()

    async def _make(self, state: CorralSandboxSessionState) -> AsyncSandbox:
        env = await state.manifest.environment.resolve()
        return await AsyncSandbox.create(
            state.image,
            worker=state.worker or self.worker,
            token_file=self.token_file,
            memory=state.memory,
            cpus=state.cpus,
            pids=state.pids,
            env=env,
            idle_timeout=state.idle_timeout,
            ttl=state.ttl,
            labels={"agents.session_id": str(state.session_id)},
        )

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: CorralSandboxClientOptions | None = None,
    ) -> SandboxSession:
        options = options or CorralSandboxClientOptions()
        manifest = self._validate_manifest_for_create(manifest or Manifest())
        session_id = uuid.uuid4()
        state = CorralSandboxSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            sandbox_id="",
            image=options.image,
            memory=options.memory,
            cpus=options.cpus,
            pids=options.pids,
            idle_timeout=options.idle_timeout,
            ttl=options.ttl,
            exposed_ports=options.exposed_ports,
        )
        sb = await self._make(state)
        state.sandbox_id = sb.id
        state.worker = sb.worker.url if self.worker or state.worker else None
        return self._wrap_session(
            CorralSandboxSession(state=state, sandbox=sb), instrumentation=self._instrumentation
        )

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, CorralSandboxSession):
            raise TypeError("CorralSandboxClient.delete expects a Corral session")
        await inner.shutdown()
        # Gone already (its worker's idle timeout, say): nothing to remove.
        with contextlib.suppress(SandboxNotFound):
            await inner.sandbox.remove()
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        if not isinstance(state, CorralSandboxSessionState):
            raise TypeError("CorralSandboxClient.resume expects a CorralSandboxSessionState")
        state.assert_path_grants_rebound()
        sb: AsyncSandbox | None = None
        try:
            sb = await AsyncSandbox.connect(
                state.sandbox_id, state.worker or self.worker, token_file=self.token_file
            )
            if (await sb.info()).state is not SandboxState.READY:
                sb = None
        except (SandboxNotFound, SandboxLost):
            sb = None
        reattached = sb is not None
        if sb is None:
            # Gone: a new one, which start() hydrates from the snapshot.
            sb = await self._make(state)
            state.sandbox_id = sb.id
            state.workspace_root_ready = False
        inner = CorralSandboxSession(state=state, sandbox=sb)
        inner._set_start_state_preserved(reattached)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, CorralSandboxSessionState)


__all__ = [
    "CorralSandboxClient",
    "CorralSandboxClientOptions",
    "CorralSandboxSession",
    "CorralSandboxSessionState",
]

"""The sync face: the async core run on one event loop of its own, in a
background thread shared by every sync object of the process."""

from __future__ import annotations

import asyncio
import builtins
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from corral import _build, _core, _rpc, _tar, _templates, _volumes
from corral.types import (
    BuiltImage,
    FileEntry,
    OutputChunk,
    PortAccess,
    PortExposure,
    Result,
    SandboxInfo,
    SandboxList,
    SandboxStats,
    TemplateInfo,
    Volume,
    WorkerInfo,
)

T = TypeVar("T")


class _Loop:
    """The background event loop (made at first use, again after a fork)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pid = 0

    def get(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None or self.pid != os.getpid():
                loop = asyncio.new_event_loop()
                _rpc.PERMANENT_LOOPS.add(loop)
                t = threading.Thread(target=loop.run_forever, name="corral-loop", daemon=True)
                t.start()
                self.loop, self.pid = loop, os.getpid()
            return self.loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if sys.is_finalizing():
            # The loop's thread may be gone already: nothing would answer.
            coro.close()
            raise RuntimeError("Python is shutting down: no more Corral calls")
        loop = self.get()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("a sync Corral call from a Corral callback: use the async face")
        started, finished = threading.Event(), threading.Event()

        async def call() -> T:
            started.set()
            try:
                return await coro
            finally:
                finished.set()

        fut = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            return fut.result()
        except BaseException:
            # The caller gave up (Ctrl-C, an exception from a signal
            # handler): the call goes with it, as on the async face (a
            # command is killed), and this waits for that to be done before
            # the caller goes on, or exits. A second Ctrl-C stops waiting.
            # (A call cancelled before it started has nothing to undo.)
            if fut.cancel() and started.is_set():
                finished.wait(timeout=CANCEL_GRACE_S)
            raise


#: How long a sync call given up on waits for its own cleanup (a command
#: killed in its sandbox).
CANCEL_GRACE_S = 10.0

_LOOP = _Loop()
#: Iterators being closed in the loop's thread (held until done).
_CLOSING: set[asyncio.Task[None]] = set()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return _LOOP.run(coro)


def _iterate(make: Callable[[], AsyncIterator[T]]) -> Generator[T, None, None]:
    """A sync iterator over an async one made in the background loop."""

    async def start() -> AsyncIterator[T]:
        return make()

    it = _run(start())

    async def step() -> T:
        return await it.__anext__()

    try:
        while True:
            try:
                yield _run(step())
            except StopAsyncIteration:
                return
    finally:
        aclose = getattr(it, "aclose", None)
        # An iterator left open until Python exits has nothing to close:
        # the loop that would close it is going too.
        if aclose is not None and not sys.is_finalizing():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not None and running is _LOOP.loop:
                # Collected in the loop's own thread (a sync iterator left
                # open, then garbage): closed there, without waiting on it.
                task = running.create_task(aclose())
                _CLOSING.add(task)
                task.add_done_callback(_CLOSING.discard)
            else:
                _run(aclose())


class Process:
    """A command running in a sandbox (see :meth:`Sandbox.start`)."""

    def __init__(self, inner: _core.AsyncProcess) -> None:
        self._p = inner

    @property
    def id(self) -> str:
        return self._p.id

    @property
    def seq(self) -> int:
        return self._p.seq

    @property
    def missed(self) -> int:
        return self._p.missed

    @classmethod
    def attach(cls, sandbox: Sandbox, process_id: str, after: int | None = None) -> Process:
        """Picks a process up again, its output from ``after`` (an
        :class:`OutputChunk`'s seq) or from its start."""
        return cls(_run(_core.AsyncProcess.attach(sandbox._sb, process_id, after)))

    @property
    def stdout(self) -> Generator[bytes, None, None]:
        return _iterate(lambda: self._p.stdout)

    @property
    def stderr(self) -> Generator[bytes, None, None]:
        return _iterate(lambda: self._p.stderr)

    def events(self) -> Generator[OutputChunk, None, None]:
        return _iterate(self._p.events)

    def wait(self, timeout: float | None = None) -> Result:
        return _run(self._p.wait(timeout))

    def write_stdin(self, data: _core.Data) -> bool:
        return _run(self._p.write_stdin(data))

    def close_stdin(self) -> None:
        _run(self._p.close_stdin())

    def signal(self, sig: int) -> bool:
        return _run(self._p.signal(sig))

    def kill(self) -> bool:
        return _run(self._p.kill())


class Files:
    """A sandbox's files (see :class:`corral.AsyncFiles`)."""

    def __init__(self, inner: _core.AsyncFiles) -> None:
        self._f = inner

    def read(self, path: _core.SandboxPath, *, max_bytes: int | None = _core.MAX_READ) -> bytes:
        return _run(self._f.read(path, max_bytes=max_bytes))

    def read_text(
        self,
        path: _core.SandboxPath,
        encoding: str = "utf-8",
        *,
        max_bytes: int | None = _core.MAX_READ,
    ) -> str:
        return _run(self._f.read_text(path, encoding, max_bytes=max_bytes))

    def write(self, path: _core.SandboxPath, data: _core.Data, mode: int | None = None) -> int:
        return _run(self._f.write(path, data, mode))

    def list(self, path: _core.SandboxPath = ".") -> list[FileEntry]:
        return _run(self._f.list(path))

    def upload(self, local: str | Path, remote: _core.SandboxPath = ".") -> int:
        return _run(self._f.upload(local, remote))

    def get_archive(self, remote: _core.SandboxPath, *, contents: bool = False) -> bytes:
        return _run(self._f.get_archive(remote, contents=contents))

    def put_archive(self, remote: _core.SandboxPath, data: bytes) -> None:
        _run(self._f.put_archive(remote, data))

    def download(self, remote: _core.SandboxPath, local: str | Path) -> _tar.Moved:
        return _run(self._f.download(remote, local))


class Ports:
    """A sandbox's ports (see :class:`corral.AsyncPorts`)."""

    def __init__(self, inner: _core.AsyncPorts) -> None:
        self._p = inner

    def expose(
        self,
        port: int,
        *,
        access: PortAccess | str = PortAccess.PRIVATE,
        ttl: float | None = None,
        wake_on_request: bool = False,
    ) -> PortExposure:
        return _run(self._p.expose(port, access=access, ttl=ttl, wake_on_request=wake_on_request))

    def revoke(self, port: int) -> bool:
        return _run(self._p.revoke(port))

    def list(self) -> builtins.list[PortExposure]:
        return _run(self._p.list())

    def wait(self, port: int, *, timeout: float = 60.0) -> None:
        _run(self._p.wait(port, timeout=timeout))


class Sandbox:
    """A sandbox on a worker. ``with Sandbox.create() as sb:`` removes it at
    the end of the block; :meth:`connect` gives one that is not removed."""

    def __init__(self, inner: _core.AsyncSandbox) -> None:
        self._sb = inner
        self.files = Files(inner.files)
        self.ports = Ports(inner.ports)

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, worker={self._sb.worker.url!r})"

    @property
    def id(self) -> str:
        return self._sb.id

    @property
    def worker(self) -> str:
        """The address of the worker the sandbox is on (``unix:///...`` for
        the local one): what ``Sandbox.connect(id, worker=...)`` takes to
        reach it again. :meth:`worker_info` says more about it."""
        return self._sb.worker.url

    @classmethod
    def create(
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
    ) -> Sandbox:
        """See :meth:`corral.AsyncSandbox.create`."""
        return cls(
            _run(
                _core.AsyncSandbox.create(
                    image,
                    worker=worker,
                    memory=memory,
                    cpus=cpus,
                    pids=pids,
                    env=env,
                    ttl=ttl,
                    idle_timeout=idle_timeout,
                    labels=labels,
                    runtime=runtime,
                    workspace_size=workspace_size,
                    network=network,
                    egress=egress,
                    root=root,
                    writable_rootfs=writable_rootfs,
                    capabilities=capabilities,
                    id=id,
                    token_file=token_file,
                    tls_ca=tls_ca,
                    tls_cert=tls_cert,
                    tls_key=tls_key,
                    tls_server_name=tls_server_name,
                    template=template,
                    volumes=volumes,
                )
            )
        )

    @classmethod
    def connect(
        cls,
        id: str,
        worker: str | None = None,
        *,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> Sandbox:
        return cls(
            _run(
                _core.AsyncSandbox.connect(
                    id,
                    worker,
                    token_file=token_file,
                    tls_ca=tls_ca,
                    tls_cert=tls_cert,
                    tls_key=tls_key,
                    tls_server_name=tls_server_name,
                )
            )
        )

    def run(
        self,
        cmd: _core.Command,
        *,
        cwd: _core.SandboxPath | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: _core.Data | None = None,
        on_stdout: Callable[[bytes], None] | None = None,
        on_stderr: Callable[[bytes], None] | None = None,
        bash: bool = False,
    ) -> Result:
        """See :meth:`corral.AsyncSandbox.run`; the callbacks run on Corral's
        background thread."""
        return _run(
            self._sb.run(
                cmd,
                cwd=cwd,
                env=env,
                timeout=timeout,
                stdin=stdin,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                bash=bash,
            )
        )

    def start(
        self,
        cmd: _core.Command,
        *,
        cwd: _core.SandboxPath | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bool = False,
        bash: bool = False,
        keep_background: bool = False,
        terminal: tuple[int, int] | None = None,
    ) -> Process:
        return Process(
            _run(
                self._sb.start(
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
        )

    def reset(self) -> int:
        """See :meth:`corral.AsyncSandbox.reset`."""
        return _run(self._sb.reset())

    def set_egress(self, rules: Sequence[str]) -> SandboxInfo:
        """See :meth:`corral.AsyncSandbox.set_egress`."""
        return _run(self._sb.set_egress(rules))

    def checkpoint(self) -> SandboxInfo:
        """See :meth:`corral.AsyncSandbox.checkpoint`."""
        return _run(self._sb.checkpoint())

    def snapshot(self, template: str) -> str:
        """See :meth:`corral.AsyncSandbox.snapshot`."""
        return _run(self._sb.snapshot(template))

    def restore(self) -> SandboxInfo:
        """See :meth:`corral.AsyncSandbox.restore`."""
        return _run(self._sb.restore())

    def get_host(self, port: int) -> str:
        """See :meth:`corral.AsyncSandbox.get_host`."""
        return _run(self._sb.get_host(port))

    def wait_for_port(self, port: int, *, timeout: float = 60.0) -> None:
        """See :meth:`corral.AsyncSandbox.wait_for_port`."""
        _run(self._sb.wait_for_port(port, timeout=timeout))

    def stats(self) -> SandboxStats:
        """See :meth:`corral.AsyncSandbox.stats`."""
        return _run(self._sb.stats())

    def info(self) -> SandboxInfo:
        return _run(self._sb.info())

    def worker_info(self) -> WorkerInfo:
        return _run(self._sb.worker_info())

    def remove(self) -> bool:
        return _run(self._sb.remove())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sb.owned:
            self.remove()


def build_image(
    context: str | os.PathLike[str],
    *,
    dockerfile: str = "Dockerfile",
    worker: str | None = None,
    token_file: str | None = None,
    timeout: float | None = None,
    on_output: Callable[[str], object] | None = None,
    max_bytes: int = _build.MAX_CONTEXT,
    template: str | None = None,
    start: str | None = None,
    ready_port: int | None = None,
    ready_command: str | None = None,
    ready_http: str | None = None,
    ready_timeout: float | None = None,
) -> BuiltImage:
    """Builds ``dockerfile`` (a path in ``context``) on a worker's Docker
    engine; see :func:`corral.abuild_image`."""
    return _run(
        _build.build_image(
            context,
            dockerfile=dockerfile,
            worker=worker,
            token_file=token_file,
            timeout=timeout,
            on_output=on_output,
            max_bytes=max_bytes,
            template=template,
            start=start,
            ready_port=ready_port,
            ready_command=ready_command,
            ready_http=ready_http,
            ready_timeout=ready_timeout,
        )
    )


def create_volume(
    name: str,
    *,
    size: int | str | None = None,
    worker: str | None = None,
    token_file: str | None = None,
) -> Volume:
    """Makes volume ``name``; see :func:`corral.acreate_volume`."""
    return _run(_volumes.create_volume(name, size=size, worker=worker, token_file=token_file))


def list_volumes(worker: str | None = None, *, token_file: str | None = None) -> list[Volume]:
    """The volumes of the workers named (or of the local worker), by name."""
    return _run(_volumes.list_volumes(worker, token_file=token_file))


def delete_volume(name: str, *, worker: str | None = None, token_file: str | None = None) -> bool:
    """Removes volume ``name`` and everything in it: whether there was one."""
    return _run(_volumes.delete_volume(name, worker=worker, token_file=token_file))


def list_templates(
    worker: str | None = None, *, token_file: str | None = None
) -> list[TemplateInfo]:
    """The templates of the workers named (or of the local worker), by name."""
    return _run(_templates.list_templates(worker, token_file=token_file))


def delete_template(
    name: str,
    *,
    force: bool = False,
    worker: str | None = None,
    token_file: str | None = None,
) -> bool:
    """Forgets template ``name``: whether a worker kept it; see
    :func:`corral.adelete_template`."""
    return _run(_templates.delete_template(name, force=force, worker=worker, token_file=token_file))


def list_sandboxes(
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
    return _run(_core.list_sandboxes(worker, labels=labels, token_file=token_file))

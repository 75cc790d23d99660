"""Images built on a worker from a Dockerfile and its context (the worker's
``BuildImage``, offered by ``corral-worker --allow-build``).

The context is packed as ``docker build`` sends it (``.dockerignore``
applied), but the same way every time: entries sorted, no times, owners
or user names, so that the same files make the same bytes and the worker,
which names an image by what it was built from, builds it once.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import io
import os
import random
import stat
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from corral import _connect, _rpc
from corral._proto import worker_pb2 as pb
from corral.errors import ConfigError, CorralError, InvalidArgument, PolicyDenied
from corral.types import BuildFailure, BuildFailureKind, BuiltImage

#: Bytes of context in one message (the worker takes at most 1 MiB).
CHUNK = 512 * 1024

_KINDS = {
    pb.BuildFailure.KIND_STEP_FAILED: BuildFailureKind.STEP_FAILED,
    pb.BuildFailure.KIND_TIMED_OUT: BuildFailureKind.TIMED_OUT,
    pb.BuildFailure.KIND_INVALID: BuildFailureKind.INVALID,
}


def _match(pattern: list[str], parts: list[str]) -> bool:
    """Whether path components ``parts`` match ``pattern`` whole: ``**``
    takes any number of components, each other one a component by
    ``fnmatch`` (``*``, ``?``, ``[...]`` within it). By table, never by
    backtracking, so no pattern makes it slow."""
    m, n = len(pattern), len(parts)
    after = [False] * (n + 1)
    after[n] = True  # the empty pattern matches the empty rest
    for i in reversed(range(m)):
        here = [False] * (n + 1)
        for j in reversed(range(n + 1)):
            if pattern[i] == "**":
                here[j] = after[j] or (j < n and here[j + 1])
            else:
                here[j] = j < n and fnmatch.fnmatchcase(parts[j], pattern[i]) and after[j + 1]
        after = here
    return after[0]


class _Ignore:
    """``.dockerignore``: the last pattern a path (or a directory above it)
    matches decides, ``!`` keeps what an earlier one left out."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, list[str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            keep = line.startswith("!")
            if keep:
                line = line[1:].strip()
            line = os.path.normpath(line.lstrip("/")).replace(os.sep, "/")
            if line in (".", ""):
                continue
            self.rules.append((keep, line.split("/")))

    def ignored(self, rel: str) -> bool:
        parts = rel.split("/")
        out = False
        for keep, pattern in self.rules:
            # A pattern that names a directory takes what is in it too.
            if any(_match(pattern, parts[:k]) for k in range(1, len(parts) + 1)):
                out = not keep
        return out


#: The largest context packed unless the caller says otherwise (a worker's
#: own bound, --max-build-context, is 512 MiB by default).
MAX_CONTEXT = 512 << 20


class _Bounded:
    """A file that takes at most ``limit`` bytes."""

    def __init__(self, f: BinaryIO, limit: int, context: Path) -> None:
        self.f, self.limit, self.n, self.context = f, limit, 0, context

    def tell(self) -> int:
        return self.n

    def write(self, b: bytes) -> int:
        self.n += len(b)
        if self.n > self.limit:
            raise ConfigError(
                f"{self.context}: the build context is over {self.limit} bytes "
                "(leave what the image does not need out with .dockerignore, or give max_bytes)"
            )
        return self.f.write(b)


def pack_context(
    context: Path,
    dockerfile: str,
    max_bytes: int = MAX_CONTEXT,
    generated: bytes | None = None,
) -> BinaryIO:
    """The context directory as a tar stream in a temporary file (read from
    its start), the same bytes for the same files. The Dockerfile and
    .dockerignore always go in (as ``docker build`` sends them); sockets,
    devices and FIFOs are refused; more than ``max_bytes`` in all is refused
    as it is packed, never held in memory. ``generated``: the Dockerfile's
    text, written at ``dockerfile`` in place of any file of that name."""
    if not context.is_dir():
        raise ConfigError(f"{context}: the build context is not a directory")
    ignore_file = context / ".dockerignore"
    ignore = _Ignore(ignore_file.read_text() if ignore_file.is_file() else "")
    always = {os.path.normpath(dockerfile).replace(os.sep, "/"), ".dockerignore"}
    out = tempfile.TemporaryFile()  # noqa: SIM115 (returned open, closed by its caller)
    bounded = _Bounded(out, max_bytes, context)
    try:
        with tarfile.open(fileobj=bounded, mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]

            def add(path: Path, rel: str) -> None:
                st = path.lstat()
                info = tarfile.TarInfo(rel)
                info.mode = stat.S_IMODE(st.st_mode)
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                    for child in sorted(os.listdir(path)):
                        crel = f"{rel}/{child}"
                        if crel in always or not ignore.ignored(crel):
                            add(path / child, crel)
                elif stat.S_ISLNK(st.st_mode):
                    info.type = tarfile.SYMTYPE
                    info.linkname = os.readlink(path)
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    if st.st_size > max_bytes:
                        # Said before a byte of it is read (a sparse file
                        # may claim far more than its disk holds).
                        raise ConfigError(
                            f"{path}: {st.st_size} bytes, over the context's bound of "
                            f"{max_bytes} (leave it out with .dockerignore, or give max_bytes)"
                        )
                    info.size = st.st_size
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    raise ConfigError(
                        f"{path}: not a file, directory or link; a context holds none"
                    )

            for child in sorted(os.listdir(context)):
                if generated is not None and child == dockerfile:
                    continue
                if child in always or not ignore.ignored(child):
                    add(context / child, child)
            if generated is not None:
                info = tarfile.TarInfo(dockerfile)
                info.mode = 0o644
                info.size = len(generated)
                tar.addfile(info, io.BytesIO(generated))
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


def context_digest(
    context: str | os.PathLike[str], dockerfile: str = "Dockerfile", max_bytes: int = MAX_CONTEXT
) -> str:
    """The hex SHA-256 of what a build of ``context`` sends (its Dockerfile's
    path and the context packed): the same files, the same digest. A
    template named by it names one content (``corral.harbor`` does so)."""
    h = hashlib.sha256(dockerfile.encode() + b"\0")
    with pack_context(Path(context), dockerfile, max_bytes) as packed:
        while piece := packed.read(CHUNK):
            h.update(piece)
    return h.hexdigest()


async def _builder(opts: _connect.Options) -> _rpc.Worker:
    """The worker to build on: the one named, or of several one that builds."""
    ws = await _rpc.workers(opts)
    if len(ws) == 1:
        return ws[0]
    infos = await asyncio.gather(
        *(w.call("GetWorkerInfo", pb.GetWorkerInfoRequest(), pb.WorkerInfo, 5.0) for w in ws),
        return_exceptions=True,
    )
    able = [
        w
        for w, i in zip(ws, infos, strict=True)
        if isinstance(i, pb.WorkerInfo) and i.policy.allow_build and not i.draining
    ]
    if not able:
        raise PolicyDenied(
            "none of the workers named builds images (corral-worker --allow-build)",
            flag="--allow-build",
        )
    return random.choice(able)


def _start(
    start: str | None,
    ready_port: int | None,
    ready_command: str | None,
    ready_http: str | None,
    ready_timeout: float | None,
) -> pb.TemplateStart:
    """What a template's sandboxes start with, checked."""
    given = [r for r in (ready_port, ready_command, ready_http) if r is not None]
    if len(given) > 1:
        raise InvalidArgument("one of ready_port, ready_command and ready_http, not several")
    s = pb.TemplateStart(command=start or "")
    if ready_port is not None:
        if isinstance(ready_port, bool) or not isinstance(ready_port, int):
            raise InvalidArgument(f"ready_port {ready_port!r}: a port number")
        if not 0 < ready_port < 65536:
            raise InvalidArgument(f"ready_port {ready_port}: 1 to 65535")
        s.port = ready_port
    elif ready_command is not None:
        s.ready_command = ready_command
    elif ready_http is not None:
        s.http = ready_http
    if ready_timeout is not None:
        if not ready_timeout > 0:
            raise InvalidArgument(f"ready_timeout {ready_timeout!r}: seconds above 0")
        s.timeout_ms = max(1, round(ready_timeout * 1000))
    return s


async def build_image(
    context: str | os.PathLike[str],
    *,
    dockerfile: str = "Dockerfile",
    worker: str | None = None,
    token_file: str | None = None,
    timeout: float | None = None,
    on_output: Callable[[str], object] | None = None,
    max_bytes: int = MAX_CONTEXT,
    template: str | None = None,
    start: str | None = None,
    ready_port: int | None = None,
    ready_command: str | None = None,
    ready_http: str | None = None,
    ready_timeout: float | None = None,
    _generated: bytes | None = None,
) -> BuiltImage:
    """Builds ``dockerfile`` (a path in ``context``) on a worker's Docker
    engine. A step that fails is a :class:`BuiltImage` with a ``failure``
    (naming the step); the worker refusing (no ``--allow-build``, a base
    image it does not allow, a context over its bound) raises. ``on_output``
    is given the build's output as it comes. With ``template``, the image is
    kept under that name with what its sandboxes start with: ``start`` (a
    command left running) and one readiness probe (``ready_port``,
    ``ready_command``, or ``ready_http`` as ``"PORT/PATH"``) tried for
    ``ready_timeout`` seconds (60 by default); ``Sandbox.create(template=)``
    makes one."""
    kept = _start(start, ready_port, ready_command, ready_http, ready_timeout)
    if template is None and (kept.command or kept.WhichOneof("ready")):
        raise InvalidArgument("start and readiness are a template's: name one (template=)")
    ctx = Path(context)
    dockerfile = dockerfile or "Dockerfile"
    if _generated is None and not (ctx / dockerfile).is_file():
        raise ConfigError(f"{ctx / dockerfile}: no such file")
    loop = asyncio.get_running_loop()
    packed = await loop.run_in_executor(None, pack_context, ctx, dockerfile, max_bytes, _generated)
    opts = _connect.Options.from_env(worker, token_file=token_file)

    async def requests() -> AsyncIterator[pb.BuildImageRequest]:
        yield pb.BuildImageRequest(
            dockerfile=dockerfile,
            timeout_ms=int(timeout * 1000) if timeout else 0,
            template=template or "",
            start=kept,
        )
        while True:
            # A read of a local temporary file: short enough for the loop.
            piece = packed.read(CHUNK)
            if not piece:
                break
            yield pb.BuildImageRequest(data=piece)
        yield pb.BuildImageRequest(eof=True)

    try:
        w = await _builder(opts)
        return await _send(w, requests(), on_output)
    finally:
        packed.close()


async def _send(
    w: _rpc.Worker,
    requests: AsyncIterator[pb.BuildImageRequest],
    on_output: Callable[[str], object] | None,
) -> BuiltImage:

    output: list[str] = []
    done: pb.BuildImageResult | None = None
    async for ev in w.build(requests):
        which = ev.WhichOneof("kind")
        if which == "output":
            output.append(ev.output)
            if on_output is not None:
                on_output(ev.output)
        elif which == "done":
            done = ev.done
    if done is None:
        raise CorralError(f"{w.url}: the build's stream ended without its result")
    failure = None
    if done.HasField("failure"):
        f = done.failure
        failure = BuildFailure(
            kind=_KINDS.get(f.kind, BuildFailureKind.STEP_FAILED),
            step=f.step,
            steps=f.steps,
            instruction=f.instruction,
            message=f.message,
        )
    return BuiltImage(
        image=done.image or None,
        worker=w.url,
        cached=done.cached,
        duration_s=done.duration_ms / 1000,
        failure=failure,
        output="".join(output),
        template=done.template.name if done.HasField("template") else None,
    )

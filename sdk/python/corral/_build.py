"""Images built on a worker from a Dockerfile and its context (the worker's
``BuildImage``, offered by ``corral-worker --allow-build``).

The context is packed as ``docker build`` sends it (``.dockerignore``
applied), but the same way every time: entries sorted, no times, owners
or user names, so that the same files make the same bytes and the worker,
which names an image by what it was built from, builds it once.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import re
import stat
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from corral import _connect, _rpc
from corral._proto import worker_pb2 as pb
from corral.errors import ConfigError, CorralError, PolicyDenied
from corral.types import BuildFailure, BuildFailureKind, BuiltImage

#: Bytes of context in one message (the worker takes at most 1 MiB).
CHUNK = 512 * 1024

_KINDS = {
    pb.BuildFailure.KIND_STEP_FAILED: BuildFailureKind.STEP_FAILED,
    pb.BuildFailure.KIND_TIMED_OUT: BuildFailureKind.TIMED_OUT,
    pb.BuildFailure.KIND_INVALID: BuildFailureKind.INVALID,
}


def _pattern(p: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression over a relative
    path: ``*`` and ``?`` within one component, ``**`` across any number."""
    out = ""
    i = 0
    while i < len(p):
        c = p[i]
        if p.startswith("**", i):
            i += 2
            if p.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = p.find("]", i + 1)
            if end < 0:
                out += re.escape(c)
            else:
                body = p[i + 1 : end].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out += f"[{body}]"
                i = end
        else:
            out += re.escape(c)
        i += 1
    # A pattern that names a directory takes what is in it too.
    return re.compile(f"(?:{out})(?:/.*)?", re.DOTALL)


class _Ignore:
    """``.dockerignore``: the last pattern a path matches decides, ``!``
    keeps what an earlier one left out."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
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
            self.rules.append((keep, _pattern(line)))

    def ignored(self, rel: str) -> bool:
        out = False
        for keep, rx in self.rules:
            if rx.fullmatch(rel):
                out = not keep
        return out


def pack_context(context: Path, dockerfile: str) -> bytes:
    """The context directory as a tar stream, the same bytes for the same
    files. The Dockerfile and .dockerignore always go in (as ``docker
    build`` sends them); sockets, devices and FIFOs are refused."""
    if not context.is_dir():
        raise ConfigError(f"{context}: the build context is not a directory")
    ignore_file = context / ".dockerignore"
    ignore = _Ignore(ignore_file.read_text() if ignore_file.is_file() else "")
    always = {os.path.normpath(dockerfile).replace(os.sep, "/"), ".dockerignore"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

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
                info.size = st.st_size
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                raise ConfigError(f"{path}: not a file, directory or link; a context holds none")

        for child in sorted(os.listdir(context)):
            if child in always or not ignore.ignored(child):
                add(context / child, child)
    return buf.getvalue()


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


async def build_image(
    context: str | os.PathLike[str],
    *,
    dockerfile: str = "Dockerfile",
    worker: str | None = None,
    token_file: str | None = None,
    timeout: float | None = None,
    on_output: Callable[[str], object] | None = None,
) -> BuiltImage:
    """Builds ``dockerfile`` (a path in ``context``) on a worker's Docker
    engine. A step that fails is a :class:`BuiltImage` with a ``failure``
    (naming the step); the worker refusing (no ``--allow-build``, a base
    image it does not allow, a context over its bound) raises. ``on_output``
    is given the build's output as it comes."""
    ctx = Path(context)
    dockerfile = dockerfile or "Dockerfile"
    if not (ctx / dockerfile).is_file():
        raise ConfigError(f"{ctx / dockerfile}: no such file")
    data = await asyncio.get_running_loop().run_in_executor(None, pack_context, ctx, dockerfile)
    opts = _connect.Options.from_env(worker, token_file=token_file)
    w = await _builder(opts)

    async def requests() -> AsyncIterator[pb.BuildImageRequest]:
        yield pb.BuildImageRequest(
            dockerfile=dockerfile,
            timeout_ms=int(timeout * 1000) if timeout else 0,
        )
        for i in range(0, len(data), CHUNK):
            yield pb.BuildImageRequest(data=data[i : i + CHUNK])
        yield pb.BuildImageRequest(eof=True)

    output: list[str] = []
    done: pb.BuildImageResult | None = None
    async for ev in w.build(requests()):
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
    )

"""Templates as programs: a Dockerfile written step by step (or read from a
file), built on a worker and kept there by name with what its sandboxes
start with, as E2B's ``Template()`` and Daytona's ``Image`` builders do::

    t = (
        Template.from_image("corral-debian:latest")
        .run("pip install flask")
        .copy("app.py", "/srv/app.py")
        .workdir("/srv")
        .env(PORT="8000")
        .start("python3 app.py", ready_http="8000/health")
    )
    t.build("web", context="./myapp")          # or: await t.abuild(...)
    sb = Sandbox.create(template="web")        # handed out once ready

The same steps and files build nothing the second time.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corral import _build
from corral.errors import InvalidArgument
from corral.types import BuiltImage

#: Where a builder's Dockerfile goes in the context it sends.
GENERATED = "Dockerfile.corral"


def _one_line(what: str, text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"{what}: a non-empty string")
    if "\n" in text or "\r" in text or "\0" in text:
        raise InvalidArgument(f"{what} {text!r}: one line, no NUL")
    return text


@dataclass(frozen=True)
class _Start:
    command: str | None = None
    ready_port: int | None = None
    ready_command: str | None = None
    ready_http: str | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class Template:
    """A template's recipe: its Dockerfile, and what its sandboxes start
    with. Each step returns a new :class:`Template` (they can be shared)."""

    _lines: tuple[str, ...] = ()
    #: A Dockerfile read from a file, relative to the build's context.
    _dockerfile: str | None = None
    _start: _Start = field(default_factory=_Start)

    @staticmethod
    def from_image(image: str) -> Template:
        """Starts from ``image`` (one the worker's policy allows)."""
        return Template(_lines=(f"FROM {_one_line('image', image)}",))

    @staticmethod
    def from_dockerfile(path: str = "Dockerfile") -> Template:
        """A Dockerfile of the build's context (``path`` within it)."""
        return Template(_dockerfile=_one_line("path", path))

    def _step(self, line: str) -> Template:
        if self._dockerfile is not None:
            raise InvalidArgument("a template from a Dockerfile takes no more steps")
        return replace(self, _lines=(*self._lines, line))

    def run(self, command: str) -> Template:
        """``RUN command`` (``sh -c``)."""
        return self._step(f"RUN {_one_line('command', command)}")

    def copy(self, src: str, dest: str) -> Template:
        """``COPY src dest``: ``src`` a path of the build's context."""
        return self._step("COPY " + json.dumps([_one_line("src", src), _one_line("dest", dest)]))

    def env(self, values: Mapping[str, str] | None = None, **more: str) -> Template:
        """``ENV KEY=VALUE`` for each."""
        t = self
        for k, v in {**(values or {}), **more}.items():
            if not k or not all(c.isalnum() or c == "_" for c in k) or k[0].isdigit():
                raise InvalidArgument(f"env {k!r}: a name of letters, digits and _")
            value = str(v)
            if "\n" in value or "\r" in value or "\0" in value:
                raise InvalidArgument(f"env {k}: one line, no NUL")
            t = t._step(f"ENV {k}={json.dumps(value, ensure_ascii=False)}")
        return t

    def workdir(self, path: str) -> Template:
        """``WORKDIR path``: where its sandboxes' commands start."""
        return self._step(f"WORKDIR {_one_line('workdir', path)}")

    def start(
        self,
        command: str | None = None,
        *,
        ready_port: int | None = None,
        ready_command: str | None = None,
        ready_http: str | None = None,
        timeout: float | None = None,
    ) -> Template:
        """What each sandbox of it starts with: ``command`` left running, and
        when it is ready (a port that accepts, a command that exits 0, or
        ``"PORT/PATH"`` answering 2xx/3xx), tried for ``timeout`` seconds."""
        return replace(
            self,
            _start=_Start(command, ready_port, ready_command, ready_http, timeout),
        )

    def dockerfile(self) -> str:
        """The Dockerfile this builds (a builder's; none for one read from
        a file)."""
        if self._dockerfile is not None:
            raise InvalidArgument("a template from a Dockerfile has no generated one")
        if not self._lines:
            raise InvalidArgument("a template starts with from_image()")
        return "\n".join(self._lines) + "\n"

    async def abuild(
        self,
        name: str,
        *,
        context: str | os.PathLike[str] | None = None,
        worker: str | None = None,
        token_file: str | None = None,
        timeout: float | None = None,
        on_output: Callable[[str], object] | None = None,
    ) -> BuiltImage:
        """Builds it on a worker as template ``name`` (``context``: the
        directory its COPY steps read; none: an empty one)."""
        generated = None if self._dockerfile is not None else self.dockerfile().encode()
        ctx = Path(context) if context is not None else None
        if ctx is None:
            if self._dockerfile is not None:
                raise InvalidArgument("from_dockerfile needs the build's context")
            with tempfile.TemporaryDirectory() as empty:
                return await self._send(
                    name, Path(empty), generated, worker, token_file, timeout, on_output
                )
        return await self._send(name, ctx, generated, worker, token_file, timeout, on_output)

    async def _send(
        self,
        name: str,
        ctx: Path,
        generated: bytes | None,
        worker: str | None,
        token_file: str | None,
        timeout: float | None,
        on_output: Callable[[str], object] | None,
    ) -> BuiltImage:
        s = self._start
        return await _build.build_image(
            ctx,
            dockerfile=self._dockerfile or GENERATED,
            worker=worker,
            token_file=token_file,
            timeout=timeout,
            on_output=on_output,
            template=name,
            start=s.command,
            ready_port=s.ready_port,
            ready_command=s.ready_command,
            ready_http=s.ready_http,
            ready_timeout=s.timeout,
            _generated=generated,
        )

    def build(self, name: str, **kw: Any) -> BuiltImage:
        """:meth:`abuild` (the same arguments), from synchronous code."""
        from corral._sync import _run

        return _run(self.abuild(name, **kw))

"""A Harbor (the Terminal-Bench harness) environment that runs a trial in a
Corral sandbox.

    harbor run -p tasks/ -a oracle -e corral.harbor:CorralEnvironment \\
        --ek worker=http://HOST:7070 --ek token_file=/path/to/token

A task's image is what Harbor's Docker environment would run: its
``environment/Dockerfile`` built on the worker's engine as a **template**
named by the task and its content (``harbor.<task>.<digest>``; ``corral-worker
--allow-build``), or the task's prebuilt ``docker_image`` (unless
``force_build``), or the image given with ``--ek image=...``. A trial first
asks for a sandbox of the template: a worker that has it, or can take it
from the fleet's registry (``corral-worker --registry``), builds nothing, so
a task is built once across runs and across workers; only where none has it
is it built, once for all the concurrent trials of the task in this process
(within the task's ``build_timeout_sec``; a failed step is an error naming
it, said to every trial of the task). Older versions of a task's template
are forgotten when a new one is built (not while sandboxes use them).
Commands start in the image's WORKDIR, or the task's ``workdir``.

Harbor works at the filesystem's root (``/logs``, ``/tests``,
``/solution``), so the sandbox runs its commands as root on a writable root
filesystem: the worker must allow both (``corral-worker --allow-root
--allow-writable-rootfs``; the local worker does), and it still has no
capability a plain ``docker run`` would not give. Commands run under
``bash -c``, never a login shell, with the task's environment; a timeout
raises as Harbor's Docker environment does. Files and trees move as tar
streams through a staging directory under /tmp.

Networks, answered truthfully: ``no-network`` is a sandbox with none (what
Corral makes by default); ``allowlist`` is egress through the worker's
proxy to the hosts, wildcards, addresses and ranges listed (on ports 80 and
443; within the worker's ``--allow-egress``); ``public`` is the worker's
bridge network (``--allow-network``). GPUs, mounts, Compose and changing
the policy after start are not offered. A task whose agent or verifier runs
as another user needs ``--ek allow_users=true``: its sandbox gets
CAP_SETUID and CAP_SETGID (``--allow-cap`` on a worker), and such commands
run through ``setpriv`` (a uid) or ``runuser`` (a name).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkMode

from corral import _templates
from corral._build import build_image, context_digest
from corral._core import AsyncSandbox
from corral.errors import CorralError
from corral.types import EndCause

#: Users that are the sandbox's own: its commands run as root.
ROOT = (None, "root", 0, "0")

#: Where this process stands with each template: a lock its trials take
#: in turn until one has it, and then the worker that has it (``None``:
#: any worker named), or why it could not be built.
_LOCKS: dict[str, asyncio.Lock] = {}
_READY: dict[str, str | None] = {}
_FAILED: dict[str, str] = {}


def template_name(task: str, digest: str) -> str:
    """``harbor.<task>.<digest>``: a template's name (at most 64 of
    ``[a-z0-9._-]``) for a task's environment of that content."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", task.lower()).strip("-_") or "task"
    return f"harbor.{slug[:43]}.{digest[:12]}"


class CorralEnvironment(BaseEnvironment):
    def __init__(
        self,
        *args: Any,
        worker: str | None = None,
        token_file: str | None = None,
        image: str | None = None,
        idle_timeout: float = 3600,
        allow_users: bool = False,
        **kwargs: Any,
    ) -> None:
        # Set before the base reads capabilities and validates.
        self._allow_users = allow_users
        self._worker = worker
        self._token_file = token_file
        self._image = image
        self._idle_timeout = idle_timeout
        self._sb: AsyncSandbox | None = None
        #: Why the sandbox could not be made, said again to every later call.
        self._start_error: BaseException | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "corral"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True,
        )

    @property
    def _dockerfile(self) -> Path:
        return Path(self.environment_dir) / "Dockerfile"

    def _validate_definition(self) -> None:
        # As Harbor's Docker environment asks: something to run.
        if self._image or getattr(self.task_env_config, "docker_image", None):
            return
        if not self._dockerfile.is_file():
            raise FileNotFoundError(
                f"{self._dockerfile} not found: the task names no docker_image and has no "
                "Dockerfile to build (or give CorralEnvironment --ek image=IMAGE)"
            )

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sb is None:
            if self._start_error is not None:
                raise RuntimeError(
                    f"no Corral sandbox: making it failed: {self._start_error}"
                ) from self._start_error
            raise RuntimeError("the Corral sandbox is not started")
        return self._sb

    async def _image_to_run(self, force_build: bool) -> tuple[str | None, str | None]:
        """The image trials run in, when it is not the task's template."""
        prebuilt = getattr(self.task_env_config, "docker_image", None)
        if self._image:
            return self._image, self._worker
        if prebuilt and (not force_build or not self._dockerfile.is_file()):
            return prebuilt, self._worker
        return None, None

    async def _create_from_template(self, force_build: bool, **spec: Any) -> AsyncSandbox:
        """A sandbox of the task's template, built where no worker has it."""
        loop = asyncio.get_running_loop()
        digest = await loop.run_in_executor(None, context_digest, self.environment_dir)
        name = template_name(self.environment_name, digest)
        if name in _FAILED:
            raise RuntimeError(_FAILED[name])
        if name in _READY and not force_build:
            try:
                return await self._create(template=name, worker=_READY[name], **spec)
            except CorralError as e:
                # Forgotten since (another run built a newer version).
                if e.reason != "no_such_template":
                    raise
                _READY.pop(name, None)
        lock = _LOCKS.setdefault(name, asyncio.Lock())
        async with lock:
            if name in _FAILED:
                raise RuntimeError(_FAILED[name])
            if name in _READY:
                return await self._create(template=name, worker=_READY[name], **spec)
            if not force_build:
                try:
                    sb = await self._create(template=name, worker=self._worker, **spec)
                    self.logger.info(f"template {name} found, nothing built")
                    _READY[name] = self._worker
                    return sb
                except CorralError as e:
                    if e.reason != "no_such_template":
                        raise
            worker = await self._build(name)
            _READY[name] = worker
        return await self._create(template=name, worker=worker, **spec)

    async def _build(self, name: str) -> str | None:
        """Builds the task's template ``name``: the worker that has it now
        when several were named."""
        timeout = getattr(self.task_env_config, "build_timeout_sec", None)
        built = await build_image(
            self.environment_dir,
            worker=self._worker,
            token_file=self._token_file,
            timeout=float(timeout) if timeout else None,
            on_output=lambda text: self.logger.debug(text.rstrip()),
            template=name,
        )
        if built.failure is not None or built.image is None:
            why = f"building {self._dockerfile} on {built.worker} failed at {built.failure}"
            _FAILED[name] = why
            raise RuntimeError(why)
        how = "found, built before" if built.cached else f"built in {built.duration_s:.1f} s"
        self.logger.info(f"template {name} ({built.image}) {how}")
        await self._forget_older(name)
        # Of several workers, the one that has it runs the trial.
        return built.worker if self._worker else None

    async def _forget_older(self, name: str) -> None:
        """Forgets this task's templates of other content (one in use stays)."""
        prefix = name.rsplit(".", 1)[0] + "."
        try:
            kept = await _templates.list_templates(self._worker, token_file=self._token_file)
        except CorralError as e:
            self.logger.debug(f"listing templates: {e}")
            return
        for old in {t.name for t in kept if t.name.startswith(prefix) and t.name != name}:
            try:
                await _templates.delete_template(
                    old, worker=self._worker, token_file=self._token_file
                )
                self.logger.info(f"template {old} forgotten: {name} is the task's now")
            except CorralError as e:
                self.logger.debug(f"template {old} kept: {e}")

    def _network(self) -> dict[str, Any]:
        """The sandbox's network for the task's policy."""
        policy = self.network_policy
        mode = getattr(policy, "network_mode", NetworkMode.PUBLIC)
        if mode == NetworkMode.NO_NETWORK:
            return {"network": "none"}
        if mode == NetworkMode.PUBLIC:
            return {"network": "bridge"}
        # Harbor's entries are Corral's rules as written: a name, *.NAME, an
        # address or a range (each on ports 80 and 443).
        return {"network": "none", "egress": list(getattr(policy, "allowed_hosts", []))}

    async def start(self, force_build: bool) -> None:
        try:
            await self._start(force_build)
        except BaseException as e:
            self._start_error = e
            raise

    async def _start(self, force_build: bool) -> None:
        cfg = self.task_env_config
        memory_mb = getattr(cfg, "memory_mb", None)
        cpus = getattr(cfg, "cpus", None)
        spec: dict[str, Any] = dict(
            env=self._startup_env(),
            memory=f"{int(memory_mb)}m" if memory_mb else None,
            cpus=float(cpus) if cpus else None,
            **self._network(),
        )
        image, worker = await self._image_to_run(force_build)
        if image is None:
            self._sb = await self._create_from_template(force_build, **spec)
        else:
            self._sb = await self._create(image=image, worker=worker, **spec)
        self.logger.info(f"Corral sandbox {self._sb.id} on {self._sb.worker.url}")
        workdir = getattr(cfg, "workdir", None)
        if workdir:
            # As an image's WORKDIR is: there before the first command.
            await self._sh('mkdir -p -- "$1"', workdir)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def _create(self, **kw: Any) -> AsyncSandbox:
        return await AsyncSandbox.create(
            token_file=self._token_file,
            root=True,
            writable_rootfs=True,
            # To run a task's commands as its agent's or verifier's user.
            capabilities=["CAP_SETUID", "CAP_SETGID"] if self._allow_users else None,
            idle_timeout=self._idle_timeout,
            labels={"harbor.session": self.session_id[:1024]},
            **kw,
        )

    async def stop(self, delete: bool) -> None:
        sb, self._sb = self._sb, None
        if sb is None or not delete:
            return
        try:
            await sb.remove()
        except CorralError as e:  # recorded as the trial's failure otherwise
            self.logger.warning(f"removing Corral sandbox {sb.id}: {e}")

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        user = self._resolve_user(user)
        argv = ["bash", "-c", command]
        if user not in ROOT:
            if not self._allow_users:
                raise RuntimeError(
                    f"this task runs commands as user {user!r}: give CorralEnvironment "
                    "--ek allow_users=true (its sandboxes then get CAP_SETUID and CAP_SETGID)"
                )
            if isinstance(user, int) or str(user).isdigit():
                # A uid needs no entry in /etc/passwd.
                argv = [
                    "setpriv",
                    f"--reuid={user}",
                    f"--regid={user}",
                    "--clear-groups",
                    "--",
                    *argv,
                ]
            else:
                argv = ["runuser", "-u", str(user), "--", *argv]
        out: list[bytes] = []
        err: list[bytes] = []
        r = await self.sandbox.run(
            argv,
            cwd=cwd or getattr(self.task_env_config, "workdir", None) or None,
            env=self._merge_env(env) or None,
            timeout=timeout_sec or None,
            on_stdout=out.append,
            on_stderr=err.append,
        )
        if r.end_cause is EndCause.TIMED_OUT:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        code = r.exit_code
        if code is None:
            raise RuntimeError(f"the command ended {r.end_cause.value}: {r.reason or ''}")
        return ExecResult(
            stdout=b"".join(out).decode("utf-8", "replace"),
            stderr=b"".join(err).decode("utf-8", "replace"),
            return_code=code,
        )

    async def _sh(self, script: str, *args: str) -> None:
        r = await self.sandbox.run(["sh", "-c", script, "sh", *args])
        if not r.ok:
            raise RuntimeError(f"in the sandbox: {r.stderr.strip() or r.end_cause.value}")

    def _stage(self) -> str:
        return f"/tmp/.corral-harbor-{uuid.uuid4().hex}"

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        stage = self._stage()
        await self.sandbox.files.write(stage, src.read_bytes(), mode=src.stat().st_mode & 0o777)
        await self._sh('mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2"', stage, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        src = Path(source_dir)
        stage = self._stage()
        await self._sh('mkdir -p -- "$1"', stage)
        try:
            await self.sandbox.files.upload(src, stage)
            await self._sh(
                'mkdir -p -- "$2" && cp -a -- "$1"/. "$2"/',
                f"{stage}/{src.name}",
                target_dir,
            )
        finally:
            with contextlib.suppress(CorralError):
                await self.sandbox.run(["rm", "-rf", "--", stage])

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        stage = self._stage()
        await self._sh('cp -- "$1" "$2"', source_path, stage)
        try:
            data = await self.sandbox.files.read(stage)
        finally:
            with contextlib.suppress(CorralError):
                await self.sandbox.run(["rm", "-f", "--", stage])
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def _merge(self, src: Path, target: Path) -> None:
        """``src``'s files and directories into ``target``, overwriting. No
        link goes into Harbor's trial directory: Harbor reads the reward and
        logs there, and a link the sandbox made would have it read whatever
        on this machine the link names."""
        target.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            dest = target / entry.name
            if entry.is_symlink():
                self.logger.warning(f"{entry.name}: a link from the sandbox, left out")
            elif entry.is_dir():
                self._merge(entry, dest)
            elif entry.is_file():
                if dest.is_symlink() or dest.is_file():
                    dest.unlink()
                shutil.copyfile(entry, dest)
                shutil.copymode(entry, dest)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        stage = self._stage()
        await self._sh('mkdir -p -- "$2" && cp -a -- "$1"/. "$2"/', source_dir, f"{stage}/d")
        try:
            with tempfile.TemporaryDirectory() as local:
                await self.sandbox.files.download(f"{stage}/d", Path(local))
                self._merge(Path(local) / "d", Path(target_dir))
        finally:
            with contextlib.suppress(CorralError):
                await self.sandbox.run(["rm", "-rf", "--", stage])


__all__ = ["CorralEnvironment"]

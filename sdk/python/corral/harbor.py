"""A Harbor (the Terminal-Bench harness) environment that runs a trial in a
Corral sandbox.

    harbor run -p tasks/ -a oracle -e corral.harbor:CorralEnvironment \\
        --ek worker=http://HOST:7070 --ek token_file=/path/to/token

Harbor works at the filesystem's root (``/logs``, ``/tests``,
``/solution``), so the sandbox runs its commands as root on a writable root
filesystem: the worker must allow both (``corral-worker --allow-root
--allow-writable-rootfs``; the local worker does), and it still has no
capability a plain ``docker run`` would not give. Commands run under
``bash -c``, never a login shell, with the task's ``workdir`` and
environment; a timeout raises as Harbor's Docker environment does. Files
and trees move as tar streams through a staging directory under /tmp.

Capabilities, answered truthfully: a sandbox with no network is one Corral
makes by default, so ``disable_internet``; a ``public`` task gets the
worker's bridge network (``--allow-network``). Allowlists, GPUs, mounts,
Compose and changing the policy after start are not offered. A task whose
agent or verifier runs as another user needs ``--ek allow_users=true``: its
sandbox gets CAP_SETUID and CAP_SETGID (``--allow-cap`` on a worker), and
such commands run through ``setpriv`` (a uid) or ``runuser`` (a name).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkMode

from corral._core import AsyncSandbox
from corral.errors import CorralError
from corral.types import EndCause

#: Users that are the sandbox's own: its commands run as root.
ROOT = (None, "root", 0, "0")


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
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "corral"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        # The image is the worker's default, a given one, or the task's
        # docker_image: no Dockerfile is built.
        return None

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sb is None:
            raise RuntimeError("the Corral sandbox is not started")
        return self._sb

    async def start(self, force_build: bool) -> None:
        cfg = self.task_env_config
        mode = getattr(self.network_policy, "network_mode", NetworkMode.PUBLIC)
        memory_mb = getattr(cfg, "memory_mb", None)
        cpus = getattr(cfg, "cpus", None)
        self._sb = await AsyncSandbox.create(
            self._image or getattr(cfg, "docker_image", None) or None,
            worker=self._worker,
            token_file=self._token_file,
            env=self._startup_env(),
            memory=f"{int(memory_mb)}m" if memory_mb else None,
            cpus=float(cpus) if cpus else None,
            network="none" if mode == NetworkMode.NO_NETWORK else "bridge",
            root=True,
            writable_rootfs=True,
            # To run a task's commands as its agent's or verifier's user.
            capabilities=["CAP_SETUID", "CAP_SETGID"] if self._allow_users else None,
            idle_timeout=self._idle_timeout,
            labels={"harbor.session": self.session_id[:1024]},
        )
        self.logger.info(f"Corral sandbox {self._sb.id} on {self._sb.worker.url}")
        workdir = getattr(cfg, "workdir", None)
        if workdir:
            # As an image's WORKDIR is: there before the first command.
            await self._sh('mkdir -p -- "$1"', workdir)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

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

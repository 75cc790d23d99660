"""A mini-swe-agent environment that runs the agent's commands in a Corral
sandbox.

Load it from a mini-swe-agent configuration::

    environment:
      environment_class: corral.miniswe.CorralEnvironment
      image: corral-debian:latest
      cwd: /workspace

It behaves as mini-swe-agent's own ``DockerEnvironment``: ``execute`` returns
``{"output", "returncode", "exception_info"}`` with stdout and stderr
together in the order they came, a command past its timeout gives
returncode -1 and a ``TimeoutExpired`` exception, the submit marker raises
``Submitted``, ``cleanup`` removes the sandbox. Commands run under
``bash -c`` (``interpreter``), never a login shell.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import platform
import shlex
import weakref
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from corral._sync import Sandbox
from corral.types import EndCause

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class CorralEnvironmentConfig(BaseModel):
    image: str = ""
    """Sandbox image; empty: the worker's default."""
    cwd: str = "/workspace"
    """Working directory of every command."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Variables of this process given to every command when set here
    (``env`` wins on a conflict)."""
    timeout: int = 30
    """Seconds a command may run."""
    interpreter: list[str] = ["bash", "-c"]
    """What runs the command (the command is its last argument)."""
    worker: str | None = None
    """Worker address(es); default ``CORRAL_WORKER``, else the local worker."""
    token_file: str | None = None
    memory: str | None = None
    cpus: float | None = None
    pids: int | None = None
    sandbox_id: str | None = None
    """Use this existing sandbox (not removed by ``cleanup``) instead of a new one."""
    idle_timeout: float | None = 3600
    """The worker removes the sandbox after this long with no call (a
    crashed agent leaves nothing behind for long)."""


def _cleanup_at_exit(ref: weakref.ref[CorralEnvironment]) -> None:
    env = ref()
    if env is not None:
        with contextlib.suppress(Exception):
            env.cleanup()


class CorralEnvironment:
    def __init__(
        self,
        *,
        config_class: type[CorralEnvironmentConfig] = CorralEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.sandbox: Sandbox | None = None
        c = self.config
        if c.sandbox_id:
            self.sandbox = Sandbox.connect(c.sandbox_id, c.worker, token_file=c.token_file)
            self._owned = False
        else:
            self.sandbox = Sandbox.create(
                c.image or None,
                worker=c.worker,
                token_file=c.token_file,
                memory=c.memory,
                cpus=c.cpus,
                pids=c.pids,
                idle_timeout=c.idle_timeout,
            )
            self._owned = True
        self.logger.info(f"Corral sandbox {self.sandbox.id} on {self.sandbox.worker}")
        # At exit, while calls can still be made (as DockerEnvironment's
        # container goes with its program).
        ref = weakref.ref(self)
        atexit.register(_cleanup_at_exit, ref)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = recursive_merge(
            self.config.model_dump(), platform.uname()._asdict(), kwargs
        )
        return out

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Runs the action's command; its output and return code."""
        command = action.get("command", "")
        assert self.sandbox is not None, "the sandbox is gone (cleanup was called)"
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        limit = timeout or self.config.timeout
        # One stream, as the model reads a terminal: stderr into stdout.
        script = "exec 2>&1; exec " + shlex.join([*self.config.interpreter, command])
        r = self.sandbox.run(script, cwd=cwd or self.config.cwd, env=env, timeout=limit)
        output: dict[str, Any]
        if r.end_cause is EndCause.TIMED_OUT:
            output = {
                "output": r.stdout,
                "returncode": -1,
                "exception_info": (
                    "An error occurred while executing the command: "
                    f"Command {command!r} timed out after {limit} seconds"
                ),
                "extra": {
                    "exception_type": "TimeoutExpired",
                    "exception": f"Command {command!r} timed out after {limit} seconds",
                },
            }
        elif r.exit_code is None:
            # Never started, canceled, its sandbox lost, out of memory.
            output = {
                "output": r.stdout,
                "returncode": -1,
                "exception_info": (
                    "An error occurred while executing the command: "
                    f"{r.end_cause.value}{': ' + r.reason if r.reason else ''}"
                ),
                "extra": {"exception_type": r.end_cause.value, "exception": r.reason or ""},
            }
        else:
            output = {"output": r.stdout, "returncode": r.exit_code, "exception_info": ""}
        if r.omitted_bytes:
            output["output"] += f"\n[{r.omitted_bytes} bytes of output omitted]\n"
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raises Submitted when the output says the task is done."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def cleanup(self) -> None:
        """Removes the sandbox this environment made."""
        sb, self.sandbox = self.sandbox, None
        if sb is not None and self._owned:
            try:
                sb.remove()
            except Exception as e:  # a worker gone: its idle timeout removes it
                self.logger.warning(f"removing sandbox {sb.id}: {e}")

    def __del__(self) -> None:
        if getattr(self, "sandbox", None) is not None:
            # At shutdown no call can be made: the idle timeout removes it.
            with contextlib.suppress(RuntimeError):
                self.cleanup()

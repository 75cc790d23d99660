"""mini-swe-agent from PyPI drives CorralEnvironment: its DefaultAgent with
its DeterministicModel plays a scripted episode, and the same episode in its
own DockerEnvironment on the same image gives the same observations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import Client

minisweagent = pytest.importorskip("minisweagent")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

IMAGE = "corral-debian:latest"
# What both environments say the same way (the Docker one's exception text
# names its container).
OBSERVATION = (
    "<returncode>{{output.returncode}}</returncode>\n"
    '{% if output.get("extra") %}'
    "<exception>{{output.extra.exception_type}}</exception>\n{% endif %}"
    "<output>\n{{output.output}}</output>"
)
STEPS = [
    "cat > hello.py <<'EOF'\nimport sys\nprint('hello from', sys.argv[1])\nEOF",
    "python3 hello.py corral && echo to-stderr >&2",
    "ls no-such-file",
    "echo before; sleep 20",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat hello.py",
]


def episode(env_config: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    env = get_environment(env_config)
    try:
        model = DeterministicModel(  # type: ignore[no-untyped-call]
            outputs=[make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(STEPS)],
            observation_template=OBSERVATION,
        )
        agent = DefaultAgent(
            model,
            env,
            system_template="You run commands.",
            instance_template="Task: {{task}}",
            step_limit=20,
            cost_limit=0,
        )
        exit_info = agent.run("write and run a script")
        observations = [m["content"] for m in agent.messages[2:] if m["role"] == "user"]
        return observations, exit_info
    finally:
        cast(Any, env).cleanup()


def test_an_episode_in_corral_matches_the_same_in_docker(worker: Client) -> None:
    common = {"image": IMAGE, "cwd": "/tmp", "timeout": 3, "env": {"PAGER": "cat"}}
    corral_obs, corral_exit = episode(
        {
            "environment_class": "corral.miniswe.CorralEnvironment",
            "worker": worker.url,
            "token_file": str(worker.token_file),
            **common,
        }
    )
    docker_obs, docker_exit = episode({"environment_class": "docker", **common})
    assert corral_exit["exit_status"] == "Submitted"
    assert corral_exit["submission"].startswith("import sys")
    assert len(corral_obs) == 4, corral_obs
    assert "hello from corral\nto-stderr\n" in corral_obs[1]
    assert "<returncode>2</returncode>" in corral_obs[2]
    assert "<exception>TimeoutExpired</exception>" in corral_obs[3]
    assert "before" in corral_obs[3]
    # The engine copies a command's stdout and stderr from two pipes into the
    # one stream `docker exec` reads, each on its own, so there a line of one
    # can overtake an earlier line of the other ("to-stderr" first, now and
    # then); Corral keeps the command's own order (checked above). The same
    # lines, then, in whatever order Docker gave them.
    assert corral_obs[:1] + corral_obs[2:] == docker_obs[:1] + docker_obs[2:]
    assert sorted(corral_obs[1].splitlines()) == sorted(docker_obs[1].splitlines())
    assert corral_exit == docker_exit


def test_the_environment_serializes_and_cleans_up(worker: Client) -> None:
    import corral
    from corral.miniswe import CorralEnvironment

    env = CorralEnvironment(worker=worker.url, token_file=str(worker.token_file), image=IMAGE)
    assert env.sandbox is not None
    sid = env.sandbox.id
    data = env.serialize()
    assert data["info"]["config"]["environment_type"] == "corral.miniswe.CorralEnvironment"
    assert data["info"]["config"]["environment"]["image"] == IMAGE
    assert env.get_template_vars()["cwd"] == "/workspace"
    out = env.execute({"command": "pwd; exit 4"})
    assert out == {"output": "/workspace\n", "returncode": 4, "exception_info": ""}
    env.cleanup()
    with pytest.raises(corral.SandboxNotFound):
        worker.connect(sid)


def test_a_program_that_exits_leaves_no_sandbox(worker: Client, tmp_path: Path) -> None:
    # An environment still referenced at exit (a module global) goes with
    # the program, as mini-swe-agent's DockerEnvironment's container does.
    script = tmp_path / "prog.py"
    script.write_text(
        "from corral.miniswe import CorralEnvironment\n"
        f"env = CorralEnvironment(worker={worker.url!r}, token_file={str(worker.token_file)!r})\n"
        "print(env.sandbox.id)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "shutting down" not in out.stderr, out.stderr
    sid = out.stdout.strip()
    assert sid not in {s.id for s in worker.list()}

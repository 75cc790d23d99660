"""Harbor 0.25 from PyPI, in a Python 3.13 image (tests/harbor/build-image.sh),
runs tasks written for this test in Harbor's task format with its oracle
agent against corral.harbor.CorralEnvironment: every task's verifier passes,
and a deliberately broken solution fails."""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

from conftest import REPO, Worker

IMAGE = "corral-harbor-test:latest"
SDK = REPO / "sdk" / "python"

TASK_TOML = """\
schema_version = "1.4"

[verifier]
timeout_sec = 120.0
env = {{ EXPECTED = "{expected}", WANT_UID = "{want_uid}", OUT = "{out}" }}

[agent]
timeout_sec = 120.0
{agent_user}
[environment]
build_timeout_sec = 600.0
network_mode = "no-network"
workdir = "/app"
env = {{ GREETING = "hi", OUT = "{out}" }}
"""

TEST_SH = """\
#!/bin/sh
mkdir -p /logs/verifier
got=$(cat "$OUT/hello.txt" 2>/dev/null)
uid=$(cat "$OUT/uid" 2>/dev/null || echo none)
if [ "$got" = "$EXPECTED" ] && [ "$(cat "$OUT/greeting")" = "hi" ] && [ "$uid" = "$WANT_UID" ]
then
  echo 1 > /logs/verifier/reward.txt
else
  echo "got '$got' from uid $uid"
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_task(
    root: Path, name: str, solve: str, expected: str = "Hello, world!", agent_user: str = ""
) -> None:
    t = root / name
    for d in ("environment", "solution", "tests"):
        (t / d).mkdir(parents=True)
    (t / "task.toml").write_text(
        TASK_TOML.format(
            expected=expected,
            want_uid=agent_user or "none",
            # A user other than root writes where anyone may.
            out="/logs/agent/out" if agent_user else "/app/out",
            agent_user=f"user = {agent_user}\n" if agent_user else "",
        )
    )
    (t / "instruction.md").write_text("Write /app/out/hello.txt saying `Hello, world!`.\n")
    (t / "environment" / "Dockerfile").write_text("FROM corral-debian:latest\nWORKDIR /app\n")
    (t / "solution" / "solve.sh").write_text(solve)
    (t / "solution" / "data.txt").write_text(f"{expected}\n")
    (t / "tests" / "test.sh").write_text(TEST_SH)


def test_harbor_runs_its_oracle_in_corral_sandboxes(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    have = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True)
    assert have.returncode == 0, f"{IMAGE} is missing: run sdk/python/tests/harbor/build-image.sh"
    w = own_worker(
        "--allow-root",
        "--allow-writable-rootfs",
        "--allow-image",
        "corral-debian:latest",
        "--allow-cap",
        "CAP_SETUID,CAP_SETGID",
    )
    tasks = tmp_path / "tasks"
    good = textwrap.dedent("""\
        #!/bin/sh
        set -e
        mkdir -p "$OUT"
        cp /solution/data.txt "$OUT/hello.txt"
        printf '%s' "$GREETING" > "$OUT/greeting"
        # A link among the logs Harbor fetches: it must not land on the host.
        ln -sf /etc/hostname /logs/agent/leak
        echo solved in "$(pwd)"
    """)
    write_task(tasks, "hello-file", good)
    write_task(tasks, "hello-other", good, expected="Hello, Corral!")
    # Its agent runs as uid 1000: the solution's files say so.
    as_user = good.replace("echo solved", 'id -u > "$OUT/uid"; echo solved')
    write_task(tasks, "hello-user", as_user, agent_user="1000")
    write_task(
        tasks,
        "hello-broken",
        '#!/bin/sh\nmkdir -p "$OUT"\necho Goodbye > "$OUT/hello.txt"\n',
    )
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    token = tmp_path / "token"
    token.write_bytes(w.token_file.read_bytes())
    token.chmod(0o600)
    run = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "-v",
            f"{tasks}:/tasks:ro",
            "-v",
            f"{jobs}:/jobs",
            "-v",
            f"{SDK}:/sdk:ro",
            "-v",
            f"{token}:/token:ro",
            "-e",
            "PYTHONPATH=/sdk",
            "-e",
            "HARBOR_TELEMETRY=0",
            "-e",
            "LITELLM_LOCAL_MODEL_COST_MAP=True",
            IMAGE,
            "harbor",
            "run",
            "-p",
            "/tasks",
            "-a",
            "oracle",
            "-e",
            "corral.harbor:CorralEnvironment",
            "--ek",
            f"worker={w.url}",
            "--ek",
            "token_file=/token",
            "--ek",
            "image=corral-debian:latest",
            "--ek",
            "allow_users=true",
            "-o",
            "/jobs",
            "--job-name",
            "corral",
            "-n",
            "2",
            "-y",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    outcomes = {}
    for p in sorted((jobs / "corral").glob("*/result.json")):
        r = json.loads(p.read_text())
        rewards = (r.get("verifier_result") or {}).get("rewards") or {}
        exc = r.get("exception_info")
        outcomes[r["task_name"]] = (rewards.get("reward"), exc and exc["exception_type"], exc)
    assert set(outcomes) == {"hello-file", "hello-other", "hello-user", "hello-broken"}, run.stdout[
        -4000:
    ]
    assert outcomes["hello-user"][:2] == (1.0, None), outcomes["hello-user"]
    assert outcomes["hello-file"][:2] == (1.0, None), outcomes["hello-file"]
    assert outcomes["hello-other"][:2] == (1.0, None), outcomes["hello-other"]
    assert outcomes["hello-broken"][:2] == (0.0, None), outcomes["hello-broken"]
    # What the oracle printed came back from the sandbox, run in the task's workdir.
    oracle = next((jobs / "corral").glob("hello-file__*/agent/oracle.txt")).read_text()
    assert "solved in /app" in oracle
    trial = next((jobs / "corral").glob("hello-file__*"))
    leak = trial / "agent" / "leak"
    assert not leak.exists() and not leak.is_symlink(), "a sandbox's link reached the host"
    # Every trial's sandbox is gone.
    left = [s for s in w.list() if "harbor.session" in s.labels]
    assert left == [], left

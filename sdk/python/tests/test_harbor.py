"""Harbor from PyPI (0.25, the oldest release the adapter supports, and
0.26, the newest), in a Python 3.13 image (tests/harbor/build-image.sh),
runs tasks laid out as real ones are (an environment/Dockerfile with a
WORKDIR, files copied in and built by RUN steps, solution/solve.sh writing
paths relative to the WORKDIR, tests/ for the verifier) with its oracle
agent against corral.harbor.CorralEnvironment: each task's Dockerfile is
built on the worker, every verifier passes, a deliberately broken solution
fails, and a Dockerfile whose step fails is an error naming the step. The
newest release runs them through a front door too, as a tenant with a key
and the front door's address alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, FrontDoor, Worker

VERSIONS = ["0.25.0", "0.26.0"]
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


# A task as real ones are made: its files come in through the Dockerfile,
# one is made by a RUN step, and nothing names a workdir but the image.
REPORT_DOCKERFILE = """\
FROM corral-debian:latest
WORKDIR /app
COPY data/ /app/data/
COPY setup.py /tmp/setup.py
RUN python3 /tmp/setup.py && rm /tmp/setup.py
ENV REPORT_NAME=report.txt
"""

REPORT_SETUP = """\
import json
json.dump({"column": "amount"}, open("/app/config.json", "w"))
"""

REPORT_SOLVE = """\
#!/bin/bash
set -euo pipefail
# Relative paths: the task's files are where its image's WORKDIR is.
python3 - <<'PY'
import csv, json, os
col = json.load(open("config.json"))["column"]
total = sum(int(r[col]) for r in csv.DictReader(open("data/sales.csv")))
open(os.environ["REPORT_NAME"], "w").write(f"total={total}\\n")
PY
echo "report written in $(pwd) by $(id -un), HOME=$HOME"
"""

REPORT_TEST = """\
#!/bin/bash
mkdir -p /logs/verifier
python3 /tests/test_outputs.py > /logs/verifier/out.txt 2>&1
echo $? > /logs/verifier/code
if [ "$(cat /logs/verifier/code)" = 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""

REPORT_CHECK = """\
from pathlib import Path
assert Path("/app/report.txt").read_text() == "total=42\\n", Path("/app/report.txt").read_text()
"""

REPORT_TOML = """\
schema_version = "1.4"

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 300.0
network_mode = "{network}"
{allowed}
"""

PROXY_SOLVE = """\
#!/bin/bash
# The allow-list's way out: the worker's proxy, named as programs look for it.
printf '%s' "${HTTPS_PROXY:-none}" > proxy.txt
"""

PROXY_CHECK = """\
from pathlib import Path
got = Path("/app/proxy.txt").read_text()
assert got.startswith("http://127.0.0.1:"), got
"""


def write_real_task(
    root: Path,
    name: str,
    *,
    dockerfile: str = REPORT_DOCKERFILE,
    solve: str = REPORT_SOLVE,
    check: str = REPORT_CHECK,
    network: str = "no-network",
    allowed: str = "",
    nonce: str = "",
) -> None:
    t = root / name
    env = t / "environment"
    (env / "data").mkdir(parents=True)
    # Of this run only (the engine keeps what earlier runs built).
    (env / "data" / "nonce").write_text(nonce)
    (env / "Dockerfile").write_text(dockerfile)
    (env / "setup.py").write_text(REPORT_SETUP)
    (env / "data" / "sales.csv").write_text("region,amount\nnorth,10\nsouth,32\n")
    (t / "solution").mkdir()
    (t / "solution" / "solve.sh").write_text(solve)
    (t / "tests").mkdir()
    (t / "tests" / "test.sh").write_text(REPORT_TEST)
    (t / "tests" / "test_outputs.py").write_text(check)
    (t / "instruction.md").write_text("Write report.txt with the total of data/sales.csv.\n")
    (t / "task.toml").write_text(REPORT_TOML.format(network=network, allowed=allowed))


@pytest.mark.parametrize(
    ("version", "via"),
    [(v, "direct") for v in VERSIONS] + [(VERSIONS[-1], "front-door")],
)
def test_harbor_builds_and_runs_real_task_layouts_in_corral_sandboxes(
    own_worker: Callable[..., Worker], tmp_path: Path, version: str, via: str
) -> None:
    image = f"corral-harbor-test:{version}"
    have = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
    assert have.returncode == 0, f"{image} is missing: run sdk/python/tests/harbor/build-image.sh"
    w = own_worker(
        "--allow-root",
        "--allow-writable-rootfs",
        "--allow-build",
        "--allow-cap",
        "CAP_SETUID,CAP_SETGID",
        "--allow-egress",
        "pypi.org,*.pythonhosted.org",
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
    # Its agent runs as uid 1000: the solution's files say so.
    as_user = good.replace("echo solved", 'id -u > "$OUT/uid"; echo solved')
    write_task(tasks, "hello-user", as_user, agent_user="1000")
    write_task(
        tasks,
        "hello-broken",
        '#!/bin/sh\nmkdir -p "$OUT"\necho Goodbye > "$OUT/hello.txt"\n',
    )
    nonce = uuid.uuid4().hex
    write_real_task(tasks, "report", nonce=nonce)
    # The same environment in three tasks, run at once: built once.
    write_real_task(tasks, "report-again", nonce=nonce)
    write_real_task(
        tasks,
        "allowlisted",
        nonce=nonce,
        solve=PROXY_SOLVE,
        check=PROXY_CHECK,
        network="allowlist",
        allowed='allowed_hosts = ["pypi.org", "*.pythonhosted.org"]',
    )
    write_real_task(
        tasks,
        "broken-build",
        dockerfile="FROM corral-debian:latest\nWORKDIR /app\nRUN echo compiling && exit 7\n",
    )
    # What `harbor init` makes: a base this worker does not allow.
    write_real_task(
        tasks,
        "init-template",
        dockerfile=(
            "FROM ubuntu:24.04\n\n"
            "# Install or copy over any environment dependencies here.\n\nWORKDIR /app"
        ),
    )
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    token = tmp_path / "token"
    url = w.url
    door = None
    if via == "front-door":
        # As a tenant: the front door's address and a key, nothing else.
        (tmp_path / "door").mkdir()
        door = FrontDoor(tmp_path / "door", w)
        url = door.url
        token.write_text(door.acme + "\n")
    else:
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
            image,
            "harbor",
            "run",
            "-p",
            "/tasks",
            "-a",
            "oracle",
            "-e",
            "corral.harbor:CorralEnvironment",
            "--ek",
            f"worker={url}",
            "--ek",
            "token_file=/token",
            "--ek",
            "allow_users=true",
            "-o",
            "/jobs",
            "--job-name",
            "corral",
            "-n",
            "3",
            "-y",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if door is not None:
        door.stop()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    outcomes = {}
    for p in sorted((jobs / "corral").glob("*/result.json")):
        r = json.loads(p.read_text())
        rewards = (r.get("verifier_result") or {}).get("rewards") or {}
        exc = r.get("exception_info")
        outcomes[r["task_name"]] = (rewards.get("reward"), exc and exc["exception_type"], exc)
    assert set(outcomes) == {
        "hello-file",
        "hello-user",
        "hello-broken",
        "report",
        "report-again",
        "allowlisted",
        "broken-build",
        "init-template",
    }, run.stdout[-4000:]
    for name in ("hello-file", "hello-user", "report", "report-again", "allowlisted"):
        assert outcomes[name][:2] == (1.0, None), (name, outcomes[name])
    assert outcomes["hello-broken"][:2] == (0.0, None), outcomes["hello-broken"]
    # The failed build says which step failed, and how.
    failed = outcomes["broken-build"][2]
    assert failed, outcomes["broken-build"]
    assert "step 3/3 (RUN echo compiling && exit 7)" in failed["exception_message"], failed
    assert "non-zero code: 7" in failed["exception_message"], failed
    # A refused base says which, and what allows it; nothing says "not started".
    refused = outcomes["init-template"][2]
    assert refused, outcomes["init-template"]
    assert "--allow-image ubuntu:24.04" in refused["exception_message"], refused
    assert "not started" not in json.dumps(refused), refused
    # What the oracle printed came back from the sandbox: run in the image's
    # WORKDIR as root, with root's HOME.
    oracle = next((jobs / "corral").glob("report__*/agent/oracle.txt")).read_text()
    assert "report written in /app by root, HOME=/root" in oracle, oracle
    oracle = next((jobs / "corral").glob("hello-file__*/agent/oracle.txt")).read_text()
    assert "solved in /app" in oracle
    trial = next((jobs / "corral").glob("hello-file__*"))
    leak = trial / "agent" / "leak"
    assert not leak.exists() and not leak.is_symlink(), "a sandbox's link reached the host"
    # Every trial's sandbox is gone.
    left = [s for s in w.list() if "harbor.session" in s.labels]
    assert left == [], left
    # Tasks of one environment (three share the report's) build it once at
    # most, however many trials ran at once: the worker says what it built.
    built = [
        json.loads(line)["fields"]["image"]
        for line in (w.root / "worker.log").read_text().splitlines()
        if "built an image" in line
    ]
    assert len(built) == len(set(built)), built
    assert 1 <= len(built) <= 2, built
    shutil.rmtree(jobs, ignore_errors=True)

"""Harbor's oracle agent on five Terminal-Bench-style tasks of the test's
own, made as real tasks are (an ``environment/Dockerfile`` with a WORKDIR,
pytest installed by a RUN step and the task's files copied in,
``solution/solve.sh`` writing paths relative to the WORKDIR,
``tests/test.sh`` running pytest), two trials of each, four at a time:

1. through ``corral.harbor:CorralEnvironment`` on a worker with the fleet's
   registry: every reward 1.0, each task's template built once;
2. through Harbor's own Docker environment (``-e docker``: Docker Compose
   v2 against the same engine), in the same run: every reward 1.0;
3. through Corral again, on a second worker of the same registry: every
   reward 1.0 and nothing built (each template comes from the registry).

The wall times of the three are said in the run's summary. The tasks ask
for Harbor's default network, ``public`` (a bridge on both sides; nothing is
sent on it): Harbor's Docker environment refuses ``no-network`` where its
egress control cannot check the kernel (its probe pulls an image)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from conftest import REPO, Worker

import corral as corral_sdk

VERSION = "0.26.0"
IMAGE = f"corral-harbor-test:{VERSION}"
SDK = REPO / "sdk" / "python"
#: pytest and what it needs, as wheels for the tasks' Python (sdk/python/test.sh).
WHEELS = REPO / "target" / "pypi" / "pytest-wheels"

TOML = """\
schema_version = "1.4"

[verifier]
timeout_sec = 180.0

[agent]
timeout_sec = 180.0

[environment]
build_timeout_sec = 600.0
network_mode = "public"
"""

# What each task's image starts with: pytest for its verifier, installed
# from wheels in its context as a task's own packages are.
BASE = """\
FROM corral-debian:latest
WORKDIR /app
COPY wheels/ /tmp/wheels/
RUN python3 -m pip install --quiet --no-index --find-links /tmp/wheels \\
    --break-system-packages pytest && rm -rf /tmp/wheels
"""

TEST_SH = """\
#!/bin/bash
mkdir -p /logs/verifier
cd /app
python3 -m pytest -p no:cacheprovider -rA /tests/test_outputs.py > /logs/verifier/pytest.txt 2>&1
if [ $? -eq 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""

TASKS: dict[str, dict[str, str]] = {
    "csv-report": {
        "Dockerfile": BASE + "COPY data/ /app/data/\nCOPY setup.py /tmp/setup.py\n"
        "RUN python3 /tmp/setup.py && rm /tmp/setup.py\nENV REPORT_NAME=report.txt\n",
        "data/sales.csv": "region,amount\nnorth,10\nsouth,32\n",
        "setup.py": 'import json\njson.dump({"column": "amount"}, open("/app/config.json", "w"))\n',
        "instruction": "Write report.txt with the total of data/sales.csv's configured column.",
        "solve": """\
python3 - <<'PY'
import csv, json, os
col = json.load(open("config.json"))["column"]
total = sum(int(r[col]) for r in csv.DictReader(open("data/sales.csv")))
open(os.environ["REPORT_NAME"], "w").write(f"total={total}\\n")
PY
""",
        "check": """\
from pathlib import Path

def test_report():
    assert Path("/app/report.txt").read_text() == "total=42\\n"
""",
    },
    "fix-the-bug": {
        "Dockerfile": BASE + "COPY src/ /app/src/\n",
        "src/calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
        "instruction": "src/calc.py's add is wrong: fix it.",
        "solve": "sed -i 's/return a - b/return a + b/' src/calc.py\n",
        "check": """\
import sys
sys.path.insert(0, "/app/src")
import calc

def test_add():
    assert calc.add(2, 3) == 5

def test_mul_untouched():
    assert calc.mul(4, 5) == 20
""",
    },
    "build-c": {
        "Dockerfile": BASE + "COPY hello.c Makefile /app/\n",
        "hello.c": '#include <stdio.h>\nint main(void) { puts("hello from c"); return 0; }\n',
        "Makefile": "hello: hello.c\n\tgcc -O2 -o hello hello.c\n",
        "instruction": "Build ./hello with the Makefile.",
        "solve": "make\n",
        "check": """\
import subprocess

def test_hello_runs():
    out = subprocess.run(["/app/hello"], capture_output=True, text=True, check=True)
    assert out.stdout == "hello from c\\n"
""",
    },
    "git-history": {
        "Dockerfile": BASE + "RUN git init -q repo && cd repo && "
        "git -c user.name=t -c user.email=t@example.invalid commit -q --allow-empty -m init\n",
        "instruction": "Commit a file notes.txt saying `done` in the repository repo.",
        "solve": """\
cd repo
echo done > notes.txt
git add notes.txt
git -c user.name=oracle -c user.email=oracle@example.invalid commit -q -m "add notes"
""",
        "check": """\
import subprocess

def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True,
                          text=True, check=True).stdout

def test_two_commits():
    assert git("rev-list", "--count", "HEAD").strip() == "2"

def test_notes_committed():
    assert git("show", "HEAD:notes.txt") == "done\\n"
""",
    },
    "word-count": {
        "Dockerfile": BASE + "COPY texts/ /app/texts/\n",
        "texts/a.txt": "the cat sat on the mat\n",
        "texts/b.txt": "the dog sat\n",
        "instruction": "Write counts.json: each word of texts/*.txt and how often it appears.",
        "solve": """\
python3 - <<'PY'
import collections, json, pathlib
words = collections.Counter()
for p in sorted(pathlib.Path("texts").glob("*.txt")):
    words.update(p.read_text().split())
json.dump(dict(words), open("counts.json", "w"), sort_keys=True)
PY
""",
        "check": """\
import json

def test_counts():
    got = json.load(open("/app/counts.json"))
    assert got == {"the": 3, "cat": 1, "sat": 2, "on": 1, "mat": 1, "dog": 1}
""",
    },
}


def write_tasks(root: Path, nonce: str) -> None:
    for name, t in TASKS.items():
        d = root / name
        env = d / "environment"
        env.mkdir(parents=True)
        (env / "wheels").mkdir()
        for w in WHEELS.glob("*.whl"):
            (env / "wheels" / w.name).write_bytes(w.read_bytes())
        # New to the engine in each run: both sides build every task.
        (env / "nonce").write_text(nonce)
        (env / "Dockerfile").write_text(t["Dockerfile"] + "COPY nonce /etc/task-nonce\n")
        for rel, text in t.items():
            if "/" in rel or "." in rel or rel == "Makefile":
                (env / rel).parent.mkdir(parents=True, exist_ok=True)
                (env / rel).write_text(text)
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text(
            "#!/bin/bash\nset -euo pipefail\n# Paths relative to the image's WORKDIR.\n"
            + t["solve"]
        )
        (d / "tests").mkdir()
        (d / "tests" / "test.sh").write_text(TEST_SH)
        (d / "tests" / "test_outputs.py").write_text(t["check"])
        (d / "instruction.md").write_text(t["instruction"] + "\n")
        (d / "task.toml").write_text(TOML)


def harbor(
    tasks: Path, jobs: Path, name: str, env_args: list[str], extra: list[str] | None = None
) -> float:
    """Runs ``harbor run`` with the oracle agent, two trials of each task,
    four at a time: its wall time. Every trial's reward must be 1.0."""
    sock = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
    argv = [
        "docker",
        "run",
        "--rm",
        "--network",
        "host",
        "-v",
        f"{tasks}:{tasks}:ro",
        # At the same path as here: Harbor's Docker environment has the
        # engine mount the trials' directories by it.
        "-v",
        f"{jobs}:{jobs}",
        "-v",
        f"{SDK}:/sdk:ro",
        "-v",
        f"{sock}:/var/run/docker.sock",
        *(extra or []),
        "-e",
        "PYTHONPATH=/sdk",
        "-e",
        "HARBOR_TELEMETRY=0",
        "-e",
        "LITELLM_LOCAL_MODEL_COST_MAP=True",
        # The classic builder: it resolves FROM in the engine's images and
        # asks no registry.
        "-e",
        "DOCKER_BUILDKIT=0",
        IMAGE,
        "harbor",
        "run",
        "-p",
        str(tasks),
        "-a",
        "oracle",
        *env_args,
        "-o",
        str(jobs),
        "--job-name",
        name,
        "-k",
        "2",
        "-n",
        "4",
        "-y",
    ]
    started = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    wall = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = {}
    for p in sorted((jobs / name).glob("*/result.json")):
        r = json.loads(p.read_text())
        reward = ((r.get("verifier_result") or {}).get("rewards") or {}).get("reward")
        exc = r.get("exception_info") or {}
        results[p.parent.name] = (r["task_name"], reward, exc.get("exception_message", "")[-600:])
    assert len(results) == 2 * len(TASKS), (name, results, run.stdout[-3000:])
    assert {t for t, _, _ in results.values()} == set(TASKS), results
    failed = {k: v for k, v in results.items() if v[1] != 1.0}
    assert not failed, (name, failed)
    return wall


def built_images(w: Worker) -> list[str]:
    return [
        json.loads(line)["fields"]["image"]
        for line in (w.root / "worker.log").read_text().splitlines()
        if "built an image" in line
    ]


def test_harbor_oracle_passes_five_real_tasks_on_corral_templates_and_on_docker(
    own_worker: Callable[..., Worker],
    registry: str,
    tmp_path: Path,
    report: Callable[[str], None],
) -> None:
    have = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True)
    assert have.returncode == 0, f"{IMAGE} is missing: run sdk/python/tests/harbor/build-image.sh"
    wheels = list(WHEELS.glob("pytest-*.whl"))
    assert wheels, f"{WHEELS}: no pytest wheel (sdk/python/test.sh downloads them)"
    flags = ("--allow-root", "--allow-writable-rootfs", "--allow-network", "--registry", registry)
    a = own_worker(*flags, "--allow-build")
    tasks = tmp_path / "tasks"
    write_tasks(tasks, uuid.uuid4().hex)
    jobs = tmp_path / "jobs"
    jobs.mkdir()

    def corral(w: Worker, name: str) -> float:
        token = tmp_path / f"token-{name}"
        token.write_bytes(w.token_file.read_bytes())
        token.chmod(0o600)
        env = ["-e", "corral.harbor:CorralEnvironment", "--ek", f"worker={w.url}"]
        env += ["--ek", "token_file=/token"]
        return harbor(tasks, jobs, name, env, ["-v", f"{token}:/token:ro"])

    cold = corral(a, "corral")
    # Each task's template built once, for both of its trials.
    built = built_images(a)
    assert len(built) == len(TASKS) == len(set(built)), built
    kept = {t.name for t in corral_sdk.list_templates(a.url, token_file=str(a.token_file))}
    for name in TASKS:
        assert any(k.startswith(f"harbor.{name}.") for k in kept), kept
    docker = harbor(tasks, jobs, "docker", ["-e", "docker"])
    # Another worker of the fleet: every template from the registry.
    b = own_worker(*flags)
    again = corral(b, "corral-again")
    assert built_images(b) == [], "the second worker built what the registry had"
    assert not [s for s in a.list() + b.list() if "harbor.session" in s.labels]
    report(
        f"Harbor oracle, {len(TASKS)} tasks x 2 trials, -n 4: Corral {cold:.1f} s "
        f"(each template built once), Harbor's Docker environment {docker:.1f} s "
        f"({cold / docker:.2f}x); Corral on a second worker from the registry {again:.1f} s "
        f"({again / docker:.2f}x)"
    )

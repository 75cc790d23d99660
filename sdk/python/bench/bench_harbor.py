"""Harbor's wall time on Corral against Harbor's own Docker environment, in
one run, on the same tasks: eight tasks laid out as real ones are (an
``environment/Dockerfile`` with a WORKDIR, files copied in and one made by a
RUN step, ``solution/solve.sh`` writing paths relative to the WORKDIR, a
Python verifier under ``tests/``), each environment different, run by
Harbor's oracle agent with ``-e docker`` and with
``-e corral.harbor:CorralEnvironment``, alternately, several rounds.

    python3.12 -m venv /tmp/hv && /tmp/hv/bin/pip install harbor ./sdk/python
    /tmp/hv/bin/python sdk/python/bench/bench_harbor.py [--rounds 3] [-n 4]

Needs what each side needs: Harbor (Python >= 3.12), the images of
``deploy/build.sh`` (the tasks start from ``corral-debian``), and for the
Docker side Docker Compose v2 (``docker compose``): where the engine has
none, ``--compose-plugin PATH`` names its binary (on Debian 12, the
``docker-compose`` package of Debian 13 carries one:
``/usr/libexec/docker/cli-plugins/docker-compose``), used through a
DOCKER_CONFIG of the bench's own.

Each round runs the tasks twice on each side: cold, every environment new
to the engine (a nonce of the round in each task's files: both sides build
all eight; the layer cache serves both alike), then warm, the same tasks
again with their images built (what a second trial of a task, or a
benchmark's many attempts, meets). The tasks ask for Harbor's default network, ``public`` (a
bridge network on both sides; nothing is sent on it): Harbor's Docker
environment refuses ``no-network`` where its egress control finds no
kernel support. A release corral-worker of the bench's own runs the Corral
side (``--allow-build --allow-root --allow-writable-rootfs
--allow-network``, the flags such a Harbor worker needs). Every trial's
reward must be 1.0 on both sides, or the bench says which failed and
stops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from own_worker import OwnWorker

REPO = Path(__file__).resolve().parents[3]
SDK = REPO / "sdk" / "python"

TOML = """\
schema_version = "1.4"

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
network_mode = "public"
"""

DOCKERFILE = """\
FROM corral-debian:latest
WORKDIR /app
COPY data/ /app/data/
COPY setup.py /tmp/setup.py
RUN python3 /tmp/setup.py && rm /tmp/setup.py
ENV REPORT_NAME=report.txt
"""

SETUP = """\
import json
json.dump({"column": "amount"}, open("/app/config.json", "w"))
"""

SOLVE = """\
#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv, json, os
col = json.load(open("config.json"))["column"]
total = sum(int(r[col]) for r in csv.DictReader(open("data/sales.csv")))
open(os.environ["REPORT_NAME"], "w").write(f"total={total}\\n")
PY
"""

TEST = """\
#!/bin/bash
mkdir -p /logs/verifier
python3 /tests/test_outputs.py > /logs/verifier/out.txt 2>&1
if [ $? = 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""

CHECK = """\
from pathlib import Path
assert Path("/app/report.txt").read_text() == "total={total}\\n"
"""


def write_tasks(root: Path, count: int, nonce: str) -> None:
    for i in range(count):
        t = root / f"report-{i}"
        (t / "environment" / "data").mkdir(parents=True)
        (t / "solution").mkdir()
        (t / "tests").mkdir()
        (t / "task.toml").write_text(TOML)
        (t / "instruction.md").write_text("Write report.txt with the total of data/sales.csv.\n")
        env = t / "environment"
        (env / "Dockerfile").write_text(DOCKERFILE)
        (env / "setup.py").write_text(SETUP)
        (env / "data" / "nonce").write_text(f"{nonce}-{i}\n")
        (env / "data" / "sales.csv").write_text(f"region,amount\nnorth,{i}\nsouth,32\n")
        (t / "solution" / "solve.sh").write_text(SOLVE)
        (t / "tests" / "test.sh").write_text(TEST)
        (t / "tests" / "test_outputs.py").write_text(CHECK.format(total=i + 32))


def harbor(
    tasks: Path, jobs: Path, name: str, env_args: list[str], n: int, env: dict[str, str]
) -> float:
    argv = [
        str(Path(sys.executable).parent / "harbor"),
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
        "-n",
        str(n),
        "-y",
    ]
    started = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"harbor {name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    failed = []
    results = sorted((jobs / name).glob("*/result.json"))
    for p in results:
        r = json.loads(p.read_text())
        reward = ((r.get("verifier_result") or {}).get("rewards") or {}).get("reward")
        if reward != 1.0:
            exc = r.get("exception_info") or {}
            failed.append((r["task_name"], reward, exc.get("exception_message", "")[:300]))
    if failed or not results:
        raise SystemExit(f"harbor {name}: trials failed: {failed or 'no results'}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("-n", type=int, default=4, help="trials at once (harbor run -n)")
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    ap.add_argument("--compose-plugin", type=Path, help="a docker-compose v2 binary")
    args = ap.parse_args()

    env = {**os.environ, "HARBOR_TELEMETRY": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env["PYTHONPATH"] = str(SDK) + os.pathsep + env.get("PYTHONPATH", "")
    scratch = Path(tempfile.mkdtemp(prefix="corral-bench-harbor-jobs-"))
    if args.compose_plugin:
        plugins = scratch / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        shutil.copy(args.compose_plugin, plugins / "docker-compose")
        env["DOCKER_CONFIG"] = str(scratch / "docker-config")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, env=env)
    if probe.returncode != 0:
        raise SystemExit("Harbor's Docker environment needs `docker compose`: see --compose-plugin")

    worker = OwnWorker(
        args.bin_dir, "--allow-build", "--allow-root", "--allow-writable-rootfs", "--allow-network"
    )
    # cold: every environment new to the engine (built on both sides);
    # warm: the same tasks again, their images built already.
    walls: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            tasks = scratch / f"tasks-{r}"
            write_tasks(tasks, args.tasks, uuid.uuid4().hex)
            sides = [
                ("docker", ["-e", "docker"]),
                (
                    "corral",
                    [
                        "-e",
                        "corral.harbor:CorralEnvironment",
                        "--ek",
                        f"worker={worker.url}",
                        "--ek",
                        f"token_file={worker.token}",
                    ],
                ),
            ]
            # Alternate which side goes first: neither always meets a cold cache.
            if r % 2:
                sides.reverse()
            for phase in ("cold", "warm"):
                for side, env_args in sides:
                    name = f"{side}-{phase}-{r}"
                    wall = harbor(tasks, scratch / "jobs", name, env_args, args.n, env)
                    walls.setdefault((side, phase), []).append(wall)
                    print(f"round {r}: {side:6} {phase} {wall:7.2f} s", flush=True)
    finally:
        worker.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    print()
    print(f"| environment | images | {args.tasks} trials, -n {args.n}: per round | median |")
    print("|---|---|---|---|")
    for (side, phase), xs in sorted(walls.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        each = ", ".join(f"{x:.1f} s" for x in xs)
        print(f"| {side} | {phase} | {each} | {statistics.median(xs):.1f} s |")
    for phase in ("cold", "warm"):
        ratio = statistics.median(walls[("corral", phase)]) / statistics.median(
            walls[("docker", phase)]
        )
        print(f"\nCorral / Docker, {phase} (medians): {ratio:.2f}x the wall time")


if __name__ == "__main__":
    main()

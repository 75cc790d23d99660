"""Every session the Rust suite ran through `corral run` has its trajectory
exported by `corral session export --atif` into target/debug/atif (see
tests/src/run.rs in the repository); each one validates against Harbor
0.25's own ATIF models (harbor.models.trajectories), in the Harbor image
(tests/harbor/build-image.sh)."""

from __future__ import annotations

import subprocess

from conftest import REPO

IMAGE = "corral-harbor-test:0.25.0"
ATIF = REPO / "target" / "debug" / "atif"

VALIDATE = """
import json, pathlib, sys
from harbor.models.trajectories import Trajectory
files = sorted(pathlib.Path("/atif").glob("*.atif.json"))
bad = []
for f in files:
    try:
        t = Trajectory.model_validate(json.loads(f.read_text()))
        assert t.session_id == f.name.removesuffix(".atif.json"), t.session_id
    except Exception as e:
        bad.append(f"{f.name}: {e}")
print(len(files))
for b in bad:
    print(b, file=sys.stderr)
sys.exit(1 if bad else 0)
"""


def test_every_session_the_suite_recorded_is_a_valid_atif_trajectory() -> None:
    have = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True)
    assert have.returncode == 0, f"{IMAGE} is missing: run sdk/python/tests/harbor/build-image.sh"
    files = sorted(ATIF.glob("*.atif.json"))
    assert len(files) >= 20, (
        f"{len(files)} trajectories in {ATIF}: the Rust suite writes them "
        "(deploy/test.sh runs it first)"
    )
    run = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            f"{ATIF}:/atif:ro",
            "-e",
            "HARBOR_TELEMETRY=0",
            IMAGE,
            "python",
            "-c",
            VALIDATE,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert int(run.stdout.strip().splitlines()[-1]) == len(files)

"""A release corral-worker of a benchmark's own, on a loopback port, with a
state directory and token of its own (removed when it stops)."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


class OwnWorker:
    def __init__(self, bin_dir: Path, *args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="corral-bench-"))
        self.token = self.dir / "token"
        self.token.write_text(secrets.token_urlsafe(32))
        self.token.chmod(0o600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        init = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "corral-init"
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "corral-worker"),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                str(self.dir / "state"),
                "--token-file",
                str(self.token),
                "--init-binary",
                str(init),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "worker.log", "wb"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"corral-worker did not start: see {self.dir / 'worker.log'}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)

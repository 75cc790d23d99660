"""Real workers for the tests: ``corral-worker`` processes on loopback ports,
each with a state directory and a token of its own, against the local
Docker engine (the binaries of ``cargo build --workspace --bins``; another
build directory with ``CORRAL_BIN_DIR``)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import corral

REPO = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("CORRAL_BIN_DIR", REPO / "target" / "debug"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Client:
    """What the tests call a worker through: its address and token file."""

    url: str
    token_file: Path

    def create(self, **kw: Any) -> corral.Sandbox:
        return corral.Sandbox.create(worker=self.url, token_file=str(self.token_file), **kw)

    def list(self) -> list[corral.SandboxInfo]:
        return corral.list_sandboxes(self.url, token_file=str(self.token_file))

    def connect(self, id: str) -> corral.Sandbox:
        return corral.Sandbox.connect(id, self.url, token_file=str(self.token_file))

    def remove_all(self) -> None:
        try:
            for s in corral.list_sandboxes(self.url, token_file=str(self.token_file)):
                corral.Sandbox.connect(s.id, self.url, token_file=str(self.token_file)).remove()
        except corral.CorralError:
            pass


class Worker(Client):
    """A corral-worker process that can be stopped, killed and started again
    on the same address and state."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        self.state = root / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.token_file = root / "token"
        if not self.token_file.exists():
            self.token_file.write_text(secrets.token_urlsafe(32) + "\n")
            self.token_file.chmod(0o600)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = open(self.root / "worker.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(BIN_DIR / "corral-worker"),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                str(self.state),
                "--token-file",
                str(self.token_file),
                "--init-binary",
                str(init_binary()),
                *self.args,
            ],
            stdout=log,
            stderr=log,
            env={**os.environ, "CORRAL_LOG_FORMAT": "json"},
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"corral-worker exited: {(self.root / 'worker.log').read_text()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("corral-worker did not listen within 30 s")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)


def init_binary() -> Path:
    p = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "corral-init"
    if not p.exists():
        raise RuntimeError(f"{p}: build the static corral-init first (deploy/test.sh does)")
    return p


class FrontDoor:
    """``corral serve --tenants DIR`` over ``worker``, with keys of two
    tenants (acme, bolt: quota sandboxes=1) and an auditor of acme's."""

    def __init__(self, root: Path, worker: Worker) -> None:
        self.tenants = root / "tenants"
        self.tenants.mkdir()
        # Made before it starts: it reads them then (a key made later takes
        # effect within a second).
        self.acme = self.key("acme", "run")
        self.bolt = self.key("bolt", "run")
        self.auditor = self.key("acme", "read")
        self.admin("quota", "set", "--tenant", "bolt", "sandboxes=1")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(root / "serve.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(BIN_DIR / "corral"),
                "--worker",
                worker.url,
                "--token-file",
                str(worker.token_file),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--serve-state-dir",
                str(root / "serve-state"),
                "--sessions-dir",
                str(root / "sessions"),
                "--tenants",
                str(self.tenants),
            ],
            stdout=log,
            stderr=log,
            env={
                k: v
                for k, v in os.environ.items()
                if k not in ("CORRAL_WORKER", "CORRAL_TOKEN_FILE", "CORRAL_URL", "CORRAL_API_KEY")
            },
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"corral serve exited: {(root / 'serve.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("corral serve did not listen within 30 s")

    def admin(self, *args: str) -> bytes:
        out = subprocess.run(
            [str(BIN_DIR / "corral"), "admin", "--tenants", str(self.tenants), *args],
            check=True,
            capture_output=True,
        )
        return out.stdout

    def key(self, tenant: str, scope: str) -> str:
        out = self.admin("key", "create", "--tenant", tenant, "--scope", scope, "--json")
        key: str = json.loads(out)["key"]
        return key

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class ThroughFrontDoor(Client):
    """A worker reached as a tenant reaches it: at a front door of its own,
    with a key of acme's as the bearer token (the same calls, the same
    answers)."""

    def __init__(self, root: Path, worker: Worker) -> None:
        self.door = FrontDoor(root, worker)
        self.url = self.door.url
        self.token_file = root / "key"
        self.token_file.write_text(self.door.acme + "\n")
        self.token_file.chmod(0o600)

    def stop(self) -> None:
        self.door.stop()


@pytest.fixture(scope="session", params=["direct", "front-door"])
def worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Client]:
    """The suite's worker: called directly, then through a front door."""
    # One name a sandbox's egress may reach (none is ever reached: the
    # tests that go out use workers of their own).
    w = Worker(
        tmp_path_factory.mktemp("worker"),
        "--allow-image",
        "corral-debian:latest",
        "--allow-egress",
        "example.org:443",
    )
    if request.param == "direct":
        yield w
    else:
        door = ThroughFrontDoor(tmp_path_factory.mktemp("front-door"), w)
        yield door
        door.remove_all()
        door.stop()
    w.remove_all()
    w.stop()


@pytest.fixture
def own_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """A worker of this test alone (one it may kill or fill)."""
    made: list[Worker] = []

    def make(*args: str) -> Worker:
        w = Worker(tmp_path / f"w{len(made)}", *args)
        made.append(w)
        return w

    yield make
    for w in made:
        if w.proc is not None and w.proc.poll() is None:
            w.remove_all()
        w.stop()


@pytest.fixture
def sb(worker: Worker) -> Iterator[corral.Sandbox]:
    with worker.create() as s:
        yield s


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """Debian's ``docker-registry`` on a loopback port of its own, storing
    in the test's directory: its ``HOST:PORT`` (a fleet's ``--registry``)."""
    root = tmp_path / "registry"
    root.mkdir()
    address = f"127.0.0.1:{free_port()}"
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  delete:\n    enabled: true\n"
        f"  filesystem:\n    rootdirectory: {root / 'data'}\nhttp:\n  addr: {address}\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        host, port = address.split(":")
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not listen") from None
                time.sleep(0.05)
        yield address
    finally:
        proc.kill()
        proc.wait()


#: What tests measured, said at the end of the run (``report`` fixture).
REPORTS: list[str] = []


@pytest.fixture
def report() -> Callable[[str], None]:
    """Says a line (a figure a test measured) in the run's summary."""
    return REPORTS.append


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORTS:
        terminalreporter.section("measured")
        for line in REPORTS:
            terminalreporter.write_line(line)

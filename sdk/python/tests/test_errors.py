"""Each typed error, produced for real by a worker."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Client, Worker

import corral


def test_an_unknown_sandbox(worker: Client) -> None:
    with pytest.raises(corral.SandboxNotFound) as e:
        worker.connect("no-such-sandbox")
    assert e.value.reason == "sandbox_not_found" and e.value.code == "NOT_FOUND"
    with worker.create() as sb:
        id = sb.id
    with pytest.raises(corral.SandboxNotFound) as e:
        worker.connect(id)
    assert e.value.reason in ("sandbox_removed", "sandbox_not_found")


def test_a_policy_refusal_names_its_flag(worker: Client) -> None:
    with pytest.raises(corral.PolicyDenied) as e:
        worker.create(memory="1p")
    assert e.value.flag == "--max-memory"
    with pytest.raises(corral.PolicyDenied) as e:
        worker.create(image="some-other-image:1")
    assert e.value.flag == "--allow-image"


def test_a_full_worker_and_a_draining_one(own_worker: Callable[..., Worker]) -> None:
    w = own_worker("--max-sandboxes", "1")
    with w.create():
        with pytest.raises(corral.ResourceExhausted) as e:
            w.create()
        assert e.value.reason == "at_capacity"
    w.signal(signal.SIGUSR1)  # drain
    deadline = time.monotonic() + 10
    while True:
        try:
            with w.create():
                pass
        except corral.WorkerUnavailable as e:
            assert e.reason == "draining"
            break
        assert time.monotonic() < deadline, "never drained"
        time.sleep(0.1)


def test_a_wrong_token_and_an_open_token_file(worker: Client, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_text("x" * 40 + "\n")
    bad.chmod(0o600)
    with pytest.raises(corral.Unauthenticated) as e:
        corral.Sandbox.create(worker=worker.url, token_file=str(bad))
    # Which token was refused, and where it came from.
    assert e.value.reason == "unauthenticated" and e.value.code == "UNAUTHENTICATED"
    assert f"read from {bad}" in str(e.value), e.value
    bad.chmod(0o644)
    with pytest.raises(corral.ConfigError):
        corral.Sandbox.create(worker=worker.url, token_file=str(bad))


def test_invalid_arguments(sb: corral.Sandbox) -> None:
    with pytest.raises(corral.InvalidArgument):
        sb.run("echo a\0b")
    with pytest.raises(corral.InvalidArgument):
        sb.run([])
    with pytest.raises(corral.InvalidArgument):
        corral.Sandbox.create(worker="http://127.0.0.1:1", memory="lots")


def test_a_lost_sandbox(worker: Client) -> None:
    sb = worker.create()
    p = sb.start("sleep 60")
    info = sb.info()
    subprocess.run(["docker", "rm", "-f", info.container_id], check=True, capture_output=True)
    r = p.wait(timeout=60)
    assert r.end_cause is corral.EndCause.SANDBOX_LOST
    with pytest.raises((corral.SandboxLost, corral.SandboxNotFound)) as e:
        sb.run("true")
    assert e.value.reason in ("sandbox_lost", "sandbox_removed", "sandbox_not_found")
    sb.remove()


def test_no_worker_there_is_said_soon(tmp_path: Path) -> None:
    from conftest import free_port

    token = tmp_path / "t"
    token.write_text("y" * 40)
    token.chmod(0o600)
    started = time.monotonic()
    with pytest.raises(corral.WorkerUnavailable):
        corral.Sandbox.create(worker=f"http://127.0.0.1:{free_port()}", token_file=str(token))
    # A worker that never answered is not waited for as a blink is.
    assert time.monotonic() - started < 30


def test_seconds_are_numbers(sb: corral.Sandbox) -> None:
    with pytest.raises(corral.InvalidArgument):
        sb.run("true", timeout="2s")  # type: ignore[arg-type]


def test_arguments_of_the_wrong_type_are_invalid_arguments(worker: Client) -> None:
    # A lone string is never split into one rule a character.
    with pytest.raises(corral.InvalidArgument, match="not one string"):
        worker.create(egress="pypi.org")
    with pytest.raises(corral.InvalidArgument, match="not one string"):
        worker.create(capabilities="CAP_CHOWN")
    with pytest.raises(corral.InvalidArgument):
        worker.create(cpus="2")
    with pytest.raises(corral.InvalidArgument):
        worker.create(pids=2.5)
    with pytest.raises(corral.InvalidArgument):
        worker.create(env={"A": 1})
    with worker.create() as sb:
        # A timeout of 0 is refused, not taken as none.
        with pytest.raises(corral.InvalidArgument):
            sb.run("echo zero", timeout=0)
        with pytest.raises(corral.InvalidArgument):
            sb.run("echo", env={"A": 1})  # type: ignore[dict-item]
        with pytest.raises(corral.InvalidArgument):
            sb.start("echo", terminal=(-1, 5))
        with pytest.raises(corral.InvalidArgument, match="not one string"):
            sb.set_egress("example.com")
        with pytest.raises(corral.InvalidArgument):
            sb.files.write("a.txt", "x", mode="644")  # type: ignore[arg-type]
        with pytest.raises(corral.InvalidArgument):
            sb.files.write("a.txt", "x", mode=0)
        p = sb.start("sleep 30")
        with pytest.raises(corral.InvalidArgument):
            p.signal("INT")  # type: ignore[arg-type]
        p.kill()
        # A file's error names its path once.
        with pytest.raises(corral.FileError) as e:
            sb.files.read("missing.txt")
        assert str(e.value).count("missing.txt") == 1, e.value


def test_values_python_would_turn_into_bytes_are_refused_not_sent(sb: corral.Sandbox) -> None:
    # bytes(5) is five NUL bytes and bytes(True) one: never written for 5.
    for data in (5, 10**6, True, [65, 66]):
        with pytest.raises(corral.InvalidArgument, match="bytes or str") as e:
            sb.files.write("n.txt", data)  # type: ignore[arg-type]
        # Told as the worker tells its own.
        assert (e.value.code, e.value.reason) == ("INVALID_ARGUMENT", "invalid_argument")
    with pytest.raises(corral.FileError):
        sb.files.read("n.txt")
    with pytest.raises(corral.InvalidArgument, match="start\\(stdin=True\\)"):
        sb.run("cat", stdin=True)  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument):
        sb.run("cat", stdin=7)  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument, match="run\\(\\) takes the bytes"):
        sb.start("cat", stdin="data")  # type: ignore[arg-type]
    p = sb.start("cat", stdin=True)
    with pytest.raises(corral.InvalidArgument):
        p.write_stdin(3)  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument):
        p.wait("1")  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument):
        p.wait(-1)
    p.kill()
    # A command is a str or a list of str; a size a number or a size string.
    for cmd in (5, b"echo hi"):
        with pytest.raises(corral.InvalidArgument, match="a command is a str"):
            sb.run(cmd)  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument):
        sb.start("true", terminal="80x24")  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidArgument, match="not a size"):
        corral.Sandbox.create(worker="http://127.0.0.1:1", memory=5e8)  # type: ignore[arg-type]
    # Bytes-like data is bytes; a path object is a path.
    from pathlib import PurePosixPath

    assert sb.files.write(PurePosixPath("p.txt"), bytearray(b"ab")) == 2
    assert sb.files.read(PurePosixPath("/workspace/p.txt")) == b"ab"
    assert [e.name for e in sb.files.list(PurePosixPath("."))] == ["p.txt"]
    assert sb.run("pwd", cwd=PurePosixPath("/tmp")).stdout == "/tmp\n"
    assert sb.run("cat", stdin=memoryview(b"in")).stdout == "in"

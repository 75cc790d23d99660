"""sb.run: a command to its end, every outcome a result."""

from __future__ import annotations

import signal
import sys
import threading
import time
import tracemalloc

import pytest

import corral
from corral import EndCause


def test_a_nonzero_exit_is_a_result_with_both_streams(sb: corral.Sandbox) -> None:
    r = sb.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.end_cause, r.ok) == (3, EndCause.EXITED, False)
    assert (r.stdout, r.stderr) == ("out\n", "err\n")
    assert r.omitted_bytes == 0 and r.duration_s >= 0
    assert sb.run("true").ok


def test_a_string_runs_under_sh_and_a_list_as_its_argv(sb: corral.Sandbox) -> None:
    # sh -c, not a login shell (whose $0 starts with "-").
    r = sb.run('echo "$0"')
    assert r.stdout.strip() in ("sh", "/bin/sh"), r.stdout
    r = sb.run(["printf", "%s|", "a b", "c'd", "$HOME", "*"])
    assert r.stdout == "a b|c'd|$HOME|*|"


def test_cwd_env_and_stdin(sb: corral.Sandbox) -> None:
    sb.run("mkdir -p sub")
    r = sb.run("pwd; echo $GREETING", cwd="sub", env={"GREETING": "hi there"})
    assert r.stdout == "/workspace/sub\nhi there\n"
    r = sb.run("wc -c", stdin=b"x" * 3_000_000)
    assert r.stdout.strip() == "3000000"
    r = sb.run("cat", stdin="text in\n")
    assert r.stdout == "text in\n"


def test_a_timeout_ends_the_command_and_says_so(sb: corral.Sandbox) -> None:
    r = sb.run("echo started; sleep 30", timeout=0.5)
    assert r.end_cause is EndCause.TIMED_OUT
    assert r.exit_code is None
    assert r.stdout == "started\n"
    assert r.duration_s < 10


def test_a_signal_is_a_result(sb: corral.Sandbox) -> None:
    r = sb.run("kill -TERM $$")
    assert r.end_cause is EndCause.SIGNALED
    assert r.signal == signal.SIGTERM
    assert r.exit_code == 128 + signal.SIGTERM


def test_a_command_that_cannot_start_says_why(sb: corral.Sandbox) -> None:
    r = sb.run("true", cwd="/workspace/no/such/dir")
    assert r.end_cause is EndCause.SPAWN_FAILED
    assert r.reason


def test_100_mb_of_stdout_reach_on_stdout_with_the_clients_memory_bounded(
    sb: corral.Sandbox,
) -> None:
    seen = 0
    chunks = 0

    def count(data: bytes) -> None:
        nonlocal seen, chunks
        seen += len(data)
        chunks += 1

    tracemalloc.start()
    try:
        r = sb.run("head -c 100000000 /dev/zero", on_stdout=count)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.ok, r
    assert seen == 100_000_000
    # The result keeps the worker's head and tail only; the rest went by.
    assert len(r.stdout_bytes) <= 2 << 20
    assert r.omitted_bytes == 100_000_000 - len(r.stdout_bytes)
    assert peak < 40 << 20, f"peak Python memory {peak} bytes"


def test_async_callbacks_and_the_async_face(worker: object) -> None:
    import asyncio

    from conftest import Client

    assert isinstance(worker, Client)

    async def main() -> None:
        async with await corral.AsyncSandbox.create(
            worker=worker.url, token_file=str(worker.token_file)
        ) as sb:
            got: list[bytes] = []

            async def hear(data: bytes) -> None:
                got.append(data)

            r = await sb.run("echo one; echo two >&2", on_stdout=hear, on_stderr=hear)
            assert r.ok
            assert sorted(b"".join(got).split()) == [b"one", b"two"]
            # Many at once, on one connection.
            results = await asyncio.gather(*(sb.run(f"echo {i}") for i in range(20)))
            assert [x.stdout for x in results] == [f"{i}\n" for i in range(20)]

    asyncio.run(main())


def test_a_callback_that_raises_ends_the_command(sb: corral.Sandbox) -> None:
    def boom(data: bytes) -> None:
        raise ValueError("no more")

    with pytest.raises(ValueError):
        sb.run("echo first; sleep 30; echo never", on_stdout=boom)
    # The command went with the call: nothing of it runs on (its kill is
    # sent at once, and done within moments).
    deadline = time.monotonic() + 10
    while "sleep 30" in sb.run("ps -o args").stdout:
        assert time.monotonic() < deadline, "the command outlived its call"
        time.sleep(0.05)


def test_ctrl_c_during_a_sync_run_ends_the_command(sb: corral.Sandbox) -> None:
    # A user's Ctrl-C, a second into the call: SIGINT to the main thread (a
    # real signal: `_thread.interrupt_main` only marks one as pending, which
    # a thread blocked on a lock sees when the call has ended anyway).
    # Python's own handler, as in a terminal (a process started in the
    # background by a non-interactive shell has SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(
        1.0, signal.pthread_kill, args=(threading.main_thread().ident, signal.SIGINT)
    )
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sb.run("sleep 30; echo never")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    # The call waited for its command's kill: none of it runs on.
    assert "sleep 30" not in sb.run("ps -o args").stdout
    deadline = time.monotonic() + 10
    while sb.info().running_operations:
        assert time.monotonic() < deadline, "the command outlived its call"
        time.sleep(0.05)


def test_what_the_journal_dropped_of_others_is_not_missed_by_a_new_process(
    sb: corral.Sandbox,
) -> None:
    # Enough output to push the first events out of the worker's journal.
    sb.run("head -c 30000000 /dev/zero")
    p = sb.start("echo tiny")
    assert b"".join(p.stdout) == b"tiny\n"
    assert p.missed == 0


def test_a_reader_that_comes_too_late_is_told_what_it_missed(sb: corral.Sandbox) -> None:
    p = sb.start("head -c 30000000 /dev/zero; echo end")
    p.wait(timeout=60)
    got = b"".join(p.stdout)
    assert got.endswith(b"end\n") and len(got) < 30_000_000
    assert p.missed > 0


def test_a_sync_iterator_dropped_in_the_loop_thread_closes_quietly(sb: corral.Sandbox) -> None:
    from corral import _sync

    p = sb.start("for i in 1 2 3; do echo $i; sleep 0.2; done")
    held = [p.stdout]
    assert next(held[0]) == b"1\n"
    seen: list[object] = []
    old = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        # Its last reference goes in the loop's own thread (as garbage
        # collected there would): closing it must not wait on that loop.
        dropped = threading.Event()

        def drop() -> None:
            held.clear()
            dropped.set()

        _sync._LOOP.get().call_soon_threadsafe(drop)
        assert dropped.wait(5)
        time.sleep(0.3)
    finally:
        sys.unraisablehook = old
    assert not seen, seen
    assert p.wait(timeout=30).exit_code == 0

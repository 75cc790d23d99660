"""sb.start: a process followed while it runs, its input fed, its end awaited."""

from __future__ import annotations

import signal

import pytest

import corral
from corral import EndCause


def test_iterators_give_each_stream_whole_and_in_order(sb: corral.Sandbox) -> None:
    p = sb.start("for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done")
    assert b"".join(p.stdout) == b"out1\nout2\nout3\n"
    # Read after the end, from the start: nothing is lost to a late reader.
    assert b"".join(p.stderr) == b"err1\nerr2\nerr3\n"
    r = p.wait()
    assert r.ok and r.stdout == "out1\nout2\nout3\n"


def test_stdin_is_written_and_closed(sb: corral.Sandbox) -> None:
    p = sb.start("tr a-z A-Z", stdin=True)
    assert p.write_stdin("hello ")
    assert p.write_stdin(b"world\n")
    p.close_stdin()
    r = p.wait(timeout=30)
    assert r.stdout == "HELLO WORLD\n"
    # It ended: its input is closed.
    assert p.write_stdin("more") is False


def test_wait_with_a_timeout_leaves_it_running_and_kill_ends_it(sb: corral.Sandbox) -> None:
    p = sb.start("sleep 30")
    with pytest.raises(TimeoutError):
        p.wait(timeout=0.3)
    assert p.kill()
    r = p.wait()
    assert r.end_cause is EndCause.CANCELED
    assert p.kill() is False


def test_a_process_unread_holds_nothing_back(sb: corral.Sandbox) -> None:
    # 20 MB on stderr nobody reads, then stdout read: no stall (Modal's
    # exec blocks here).
    p = sb.start("head -c 20000000 /dev/zero >&2; echo done")
    assert b"".join(p.stdout) == b"done\n"
    assert p.wait().ok


def test_events_carry_seqs_that_attach_goes_on_from(sb: corral.Sandbox) -> None:
    p = sb.start("echo a; sleep 0.2; echo b; sleep 0.2; echo c")
    events = p.events()
    first = next(events)
    assert first.data == b"a\n" and first.stream == "stdout"
    events.close()
    again = corral.Process.attach(sb, p.id, after=first.seq)
    assert b"".join(again.stdout) == b"b\nc\n"
    whole = corral.Process.attach(sb, p.id)
    assert b"".join(whole.stdout) == b"a\nb\nc\n"
    assert whole.wait().ok


def test_many_processes_at_once(sb: corral.Sandbox) -> None:
    ps = [sb.start(f"sleep 0.2; echo {i}") for i in range(10)]
    assert [p.wait().stdout for p in ps] == [f"{i}\n" for i in range(10)]


def test_signals_reach_the_command_and_its_group(sb: corral.Sandbox) -> None:
    p = sb.start("trap 'echo got INT; exit 7' INT; echo ready; while :; do sleep 0.05; done")
    it = p.stdout
    assert next(it) == b"ready\n"
    assert p.signal(signal.SIGINT)
    r = p.wait(timeout=30)
    assert (r.exit_code, r.stdout) == (7, "ready\ngot INT\n")
    assert p.signal(signal.SIGINT) is False
    q = sb.start("sleep 30")
    assert q.signal(signal.SIGKILL)
    assert q.wait(timeout=30).signal == signal.SIGKILL
    with pytest.raises(corral.InvalidArgument):
        sb.start("sleep 1").signal(0)
    with pytest.raises(corral.ProcessNotFound):
        corral.Process(corral.AsyncProcess(sb._sb, "no-such-op")).signal(signal.SIGTERM)

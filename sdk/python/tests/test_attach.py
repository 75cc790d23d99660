"""Process.attach: a process picked up again, every line exactly once, after
its client was killed and after its worker restarted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from conftest import Client, Worker

import corral

LINES = 30
COUNT = f"i=1; while [ $i -le {LINES} ]; do echo line$i; i=$((i+1)); sleep 0.05; done"


def _lines(data: bytes) -> list[str]:
    return data.decode().split()


def test_attach_after_the_client_was_sigkilled(worker: Client, tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys
        import corral
        sb = corral.Sandbox.connect(sys.argv[1], {worker.url!r},
                                    token_file={str(worker.token_file)!r})
        p = sb.start({COUNT!r})
        print(p.id, flush=True)
        n = 0
        with open({str(seen)!r}, "a") as out:
            for chunk in p.events():
                out.write(f"{{chunk.seq}} {{chunk.data.decode()!r}}\\n")
                out.flush()
                n += chunk.data.count(b"\\n")
                if n >= 5:
                    os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    with worker.create() as sb:
        child = subprocess.run(
            [sys.executable, str(script), sb.id], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == -9, child.stderr
        process_id = child.stdout.split()[0]
        got = b""
        last = 0
        for line in seen.read_text().splitlines():
            seq, data = line.split(" ", 1)
            got += eval(data).encode()  # the client's own repr of a str
            last = int(seq)
        p = corral.Process.attach(sb, process_id, after=last)
        got += b"".join(p.stdout)
        assert _lines(got) == [f"line{i}" for i in range(1, LINES + 1)]
        assert p.wait().ok


def test_attach_and_follow_across_a_worker_restart(
    own_worker: Callable[..., Worker],
) -> None:
    w = own_worker()
    with w.create() as sb:
        p = sb.start(COUNT)
        events = p.events()
        got = b""
        while got.count(b"\n") < 5:
            got += next(events).data
        # The worker dies and comes back on the same address and state: the
        # same iterator goes on, nothing lost or repeated.
        w.kill()
        w.start()
        for chunk in events:
            got += chunk.data
        assert _lines(got) == [f"line{i}" for i in range(1, LINES + 1)]
        # A new client picks it up too, from its start.
        again = corral.Process.attach(w.connect(sb.id), p.id)
        assert _lines(b"".join(again.stdout)) == [f"line{i}" for i in range(1, LINES + 1)]
        assert again.wait().ok

"""How fast a command is from Python: ``sb.run("true")`` against ``docker exec``
(a subprocess, as Python programs call it) and, when openai-agents is
installed, the Agents SDK's own Docker sandbox client, on the same image in
the same run; then runs per second from 8 threads and from 8 asyncio tasks
over 4 sandboxes.

    python sdk/python/bench/bench_run.py [--samples 300] [--bin-dir target/release]

It starts a corral-worker of its own (release build by default) on a
loopback port, with a state directory and token of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from own_worker import OwnWorker

import corral

REPO = Path(__file__).resolve().parents[3]
IMAGE = "corral-sandbox:latest"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def timed(f: Callable[[], Any], n: int, warm: int = 10) -> list[float]:
    for _ in range(warm):
        f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1000)
    return out


def row(name: str, xs: list[float]) -> str:
    return (
        f"| {name} | {statistics.median(xs):.2f} ms | {pct(xs, 90):.2f} ms "
        f"| {pct(xs, 99):.2f} ms | {len(xs)} |"
    )


def docker_exec(samples: int) -> list[float]:
    cid = subprocess.run(
        ["docker", "run", "-d", "--rm", "--network", "none", IMAGE, "sleep", "3600"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        return timed(
            lambda: subprocess.run(["docker", "exec", cid, "true"], check=True), samples, warm=3
        )
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


def agents_docker(samples: int) -> list[float] | None:
    """The Agents SDK's Docker sandbox client on the same image, if installed."""
    try:
        import docker  # type: ignore[import-untyped]
        from agents.sandbox import Manifest
        from agents.sandbox.sandboxes.docker import (
            DockerSandboxClient,
            DockerSandboxClientOptions,
        )
    except ImportError:
        return None

    async def main() -> list[float]:
        client = DockerSandboxClient(docker.from_env())
        session = await client.create(
            manifest=Manifest(), options=DockerSandboxClientOptions(image=IMAGE)
        )
        try:
            await session.start()
            for _ in range(5):
                await session.exec("true", shell=True)
            out = []
            for _ in range(samples):
                t = time.perf_counter()
                await session.exec("true", shell=True)
                out.append((time.perf_counter() - t) * 1000)
            return out
        finally:
            await client.delete(session)

    try:
        return asyncio.run(main())
    except Exception as e:  # an SDK whose API moved: said, not hidden
        print(f"agents docker client: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def threads(w: OwnWorker, seconds: float) -> float:
    sbs = [corral.Sandbox.create(IMAGE, worker=w.url, token_file=str(w.token)) for _ in range(4)]
    stop = time.monotonic() + seconds
    counts = [0] * 8

    def loop(i: int) -> None:
        sb = sbs[i % 4]
        while time.monotonic() < stop:
            sb.run("true")
            counts[i] += 1

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for sb in sbs:
        sb.remove()
    return sum(counts) / seconds


def tasks(w: OwnWorker, seconds: float) -> float:
    async def main() -> float:
        sbs = [
            await corral.AsyncSandbox.create(IMAGE, worker=w.url, token_file=str(w.token))
            for _ in range(4)
        ]
        loop = asyncio.get_running_loop()
        stop = loop.time() + seconds
        counts = [0] * 8

        async def one(i: int) -> None:
            while loop.time() < stop:
                await sbs[i % 4].run("true")
                counts[i] += 1

        await asyncio.gather(*(one(i) for i in range(8)))
        for sb in sbs:
            await sb.remove()
        return sum(counts) / seconds

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    args = ap.parse_args()
    os.environ.pop("CORRAL_WORKER", None)
    w = OwnWorker(args.bin_dir)
    try:
        sb = corral.Sandbox.create(IMAGE, worker=w.url, token_file=str(w.token))
        sync = timed(lambda: sb.run("true"), args.samples)

        async def async_face() -> list[float]:
            a = await corral.AsyncSandbox.connect(sb.id, w.url, token_file=str(w.token))
            for _ in range(10):
                await a.run("true")
            out = []
            for _ in range(args.samples):
                t = time.perf_counter()
                await a.run("true")
                out.append((time.perf_counter() - t) * 1000)
            return out

        asynchronous = asyncio.run(async_face())
        sb.remove()
        dexec = docker_exec(max(30, args.samples // 3))
        agents = agents_docker(max(30, args.samples // 3))
        th = threads(w, args.seconds)
        tk = tasks(w, args.seconds)
    finally:
        w.stop()
    print("| measurement | p50 | p90 | p99 | samples |")
    print("|---|---|---|---|---|")
    print(row('`sb.run("true")`, sync face', sync))
    print(row('`await sb.run("true")`, async face', asynchronous))
    print(row("`docker exec CONTAINER true` (subprocess)", dexec))
    if agents is not None:
        print(row('Agents SDK `DockerSandboxClient` `session.exec("true")`', agents))
    print()
    p50 = statistics.median(sync)
    print(
        f"- `docker exec` / `sb.run`: **{statistics.median(dexec) / p50:.1f}x** (p50), "
        f"{pct(dexec, 99) / pct(sync, 99):.1f}x (p99)"
    )
    if agents is not None:
        print(
            f"- Agents SDK Docker client / `sb.run`: "
            f"**{statistics.median(agents) / p50:.1f}x** (p50)"
        )
    print(f"- runs per second, 8 threads over 4 sandboxes: {th:.0f}")
    print(f"- runs per second, 8 asyncio tasks over 4 sandboxes: {tk:.0f}")


if __name__ == "__main__":
    main()

"""What the HTTP/JSON API costs beside gRPC, in the same run against the
same worker: ``run("true")`` to its end through the Python SDK (gRPC) and
through ``POST /v1/sandboxes/{id}/run`` (one keep-alive HTTP/1.1
connection, the answer's NDJSON read to its end), and a sandbox's ``GET``
both ways; then ``docker exec`` of the same command, the usual alternative.

    python sdk/python/bench/bench_http.py [--samples 300] [--bin-dir target/release]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench_run import pct, timed
from own_worker import OwnWorker

import corral

REPO = Path(__file__).resolve().parents[3]
IMAGE = "corral-sandbox:latest"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    args = ap.parse_args()
    w = OwnWorker(args.bin_dir, "--allow-image", IMAGE)
    rows: list[tuple[str, list[float]]] = []
    try:
        token = w.token.read_text().strip()
        with corral.Sandbox.create(IMAGE, worker=w.url, token_file=str(w.token)) as sb:
            conn = http.client.HTTPConnection("127.0.0.1", w.port)
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            body = json.dumps({"spec": {"shell": {"command": "true"}}})

            def http_run() -> None:
                conn.request("POST", f"/v1/sandboxes/{sb.id}/run", body, headers)
                r = conn.getresponse()
                lines = [json.loads(x) for x in r.read().splitlines() if x.strip()]
                assert r.status == 200 and "finished" in lines[-1]["event"], lines[-1]

            def http_get() -> None:
                conn.request("GET", f"/v1/sandboxes/{sb.id}", headers=headers)
                r = conn.getresponse()
                data: Any = json.loads(r.read())
                assert r.status == 200 and data["id"] == sb.id

            rows.append(
                ("gRPC (Python SDK): run true", timed(lambda: sb.run("true"), args.samples))
            )
            rows.append(("HTTP/JSON: POST .../run true", timed(http_run, args.samples)))
            rows.append(("gRPC (Python SDK): get sandbox", timed(sb.info, args.samples)))
            rows.append(("HTTP/JSON: GET /v1/sandboxes/{id}", timed(http_get, args.samples)))
            container = sb.info().container_id
            rows.append(
                (
                    "docker exec true",
                    timed(
                        lambda: subprocess.run(["docker", "exec", container, "true"], check=True),
                        max(30, args.samples // 10),
                        warm=3,
                    ),
                )
            )
    finally:
        w.stop()
    print("| call | p50 | p90 | mean |")
    print("|---|---|---|---|")
    for name, xs in rows:
        p50, p90, mean = pct(xs, 50), pct(xs, 90), statistics.mean(xs)
        print(f"| {name} | {p50:.2f} ms | {p90:.2f} ms | {mean:.2f} ms |")


if __name__ == "__main__":
    main()

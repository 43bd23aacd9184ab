"""Oversized prompts against a running `kvcore serve`, on loopback only: are they refused fast while /health
keeps answering, and does the server's memory stay put?

Sends ``--count`` completions whose prompt is ``--megabytes`` MB of text, one after another, while a thread
polls ``GET /health`` every 10 ms; then one small completion. Prints the refusals' latency, the /health
latencies during the flood, and (with ``--pid``) the server's RSS before and after. Exit code 0 when every
oversized prompt got a 400, /health always answered 200 and the small completion a 200.

    prlimit --as=4294967296 kvcore serve --model tests/data/tiny-llama --port 8765 &
    python benchmarks/studies/prompt_flood.py --port 8765 --pid $!
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def call(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--megabytes", type=float, default=15.0)
    parser.add_argument("--pid", type=int, default=None, help="the server's pid, to report its RSS")
    args = parser.parse_args()
    text = "hello world " * int(args.megabytes * 1e6 / 12)
    data = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    before = rss_mib(args.pid) if args.pid else None
    health: list[tuple[int, float]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            health.append((call(args.port, "GET", "/health"), time.perf_counter() - t0))
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    refusals = []
    for _ in range(args.count):
        t0 = time.perf_counter()
        refusals.append((call(args.port, "POST", "/v1/completions", data), time.perf_counter() - t0))
    done.set()
    poller.join()
    small = call(args.port, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
    seconds = sorted(s for _, s in health)
    report = {
        "refusal_statuses": sorted({s for s, _ in refusals}),
        "refusal_s": {"median": statistics.median(s for _, s in refusals), "max": max(s for _, s in refusals)},
        "health_statuses": sorted({s for s, _ in health}),
        "health_s": {"n": len(seconds), "median": statistics.median(seconds),
                     "p95": seconds[int(0.95 * (len(seconds) - 1))], "max": seconds[-1]},
        "small_completion_status": small,
    }
    if args.pid:
        report["rss_mib"] = {"before": round(before, 1), "after": round(rss_mib(args.pid), 1)}
    print(json.dumps(report, indent=2))
    ok = report["refusal_statuses"] == [400] and report["health_statuses"] == [200] and small == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

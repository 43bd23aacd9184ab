"""A bounded load test of `kvcore serve`, on loopback only.

Starts `kvcore serve` on 127.0.0.1 (a free port), warms it up, then runs ``--requests`` streaming
completions from ``--concurrency`` clients at once, with random prompt and output lengths; ``--disconnect``
of them hang up mid-stream. With ``--nan-fraction``, that fraction of the requests are poisoned: the server
runs with a test backend (``nan_server.py``) that turns a marked request's keys and values into NaN, and the
request is marked by its length (``--nan-prompt-tokens`` token ids of random words, more than any other request
reaches).
``--duration`` repeats rounds until the load has run that long (a soak). Afterwards it checks:

- no server errors (HTTP 5xx, error events in a stream, broken connections the client did not cause) on any
  request but the poisoned ones, and each poisoned one failed with a one-line error naming the NaN (an error
  event or a typed error body, never ``internal_error``); no traceback in the server's log;
- every completed greedy stream equals the same request run alone (one at a time, same server), and every
  disconnected one is a prefix of it;
- ``/health`` (polled all through the load) answered 200 every time;
- the KV blocks in use return to 0 and the server's RSS returns to its level after a warm-up round;

and reports requests/s, output tokens/s, TTFT and TPOT percentiles (client side). It stops by itself:
the number of requests is fixed and ``--time-limit`` bounds the whole run. Exit code 0 when every check
passes, 1 otherwise.

    python benchmarks/studies/load_test.py --model tests/data/tiny-llama --requests 300 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"  # loopback only, by design: this tool never talks to another address
WORDS = ("the of and to in is was for on that with as by at from his her an be which it are this "
         "river castle engine orange quantum violet market ladder thunder silver garden winter").split()


@dataclass
class Outcome:
    prompt: str | tuple[int, ...]  # text, or token ids (a poisoned request)
    max_tokens: int
    hang_up_after: int | None  # chunks read before disconnecting, or None
    is_poisoned: bool = False
    text: str = ""
    status: int = 0
    error: str | None = None
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None


async def _read_chunked(reader: asyncio.StreamReader):
    """The body of a chunked HTTP/1.1 response, piece by piece."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def stream_completion(port: int, model: str, out: Outcome, timeout: float) -> Outcome:
    prompt = out.prompt if isinstance(out.prompt, str) else list(out.prompt)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": out.max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    out.start = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        async with asyncio.timeout(timeout):
            out.status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            if out.status != 200:
                out.error = (await reader.read()).decode(errors="replace")[:300]
                return out
            buffer, chunks = b"", 0
            async for piece in _read_chunked(reader):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = event.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        return out
                    payload = json.loads(data)
                    if "error" in payload:
                        out.error = payload["error"]["message"]
                        return out
                    choice = payload["choices"][0]
                    out.text += choice["text"]
                    out.token_times.append(time.perf_counter())
                    out.finish_reason = choice["finish_reason"] or out.finish_reason
                    chunks += 1
                    if out.hang_up_after is not None and chunks >= out.hang_up_after:
                        return out  # hang up mid-stream
            out.error = "the stream ended without data: [DONE]"
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
    return out


async def get(port: int, path: str) -> tuple[int, str]:
    """``(status, body)`` of ``GET path``."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def tokenize(port: int, text: str) -> list[int]:
    body = json.dumps({"prompt": text}).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    raw = await reader.read()
    writer.close()
    return json.loads(raw.partition(b"\r\n\r\n")[2])["tokens"]


async def poll_health(port: int, answers: list[tuple[int, str]], period: float = 0.25) -> None:
    """``GET /health`` every ``period`` seconds until cancelled, each answer appended to ``answers``."""
    while True:
        try:
            answers.append(await get(port, "/health"))
        except OSError as exc:
            answers.append((0, f"{type(exc).__name__}: {exc}"))
        await asyncio.sleep(period)


def clean_nan_error(o: Outcome) -> bool:
    """A poisoned request failed as it should: an error naming the NaN, in a stream's error event or a typed
    error body (not ``internal_error``)."""
    return o.error is not None and "NaN" in o.error and "internal_error" not in o.error


def gauge(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics_text, re.M)
    return float(match.group(1)) if match else float("nan")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


async def wait_idle(port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = (await get(port, "/metrics"))[1]
        busy = gauge(text, "kvcore_kv_blocks_in_use") + gauge(text, "kvcore_num_requests_running")
        if busy == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace, port: int, pid: int) -> dict:
    rng = random.Random(args.seed)
    model = args.served_model_name

    def fresh() -> tuple[str, int]:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, args.max_prompt_words))), \
            rng.randint(1, args.max_tokens)

    pool = [fresh() for _ in range(args.prompt_pool)]  # the alone oracle then runs each once
    num_poison = args.nan_prompt_tokens
    # every word is at least one token: a poisoned prompt is a window of this text's ids, fresh enough per request
    words = " ".join(rng.choice(WORDS) for _ in range(4 * num_poison)) if args.nan_fraction else ""
    poison_ids = await tokenize(port, words) if words else []

    def job(i: int) -> Outcome:
        if rng.random() < args.nan_fraction:
            start = rng.randrange(len(poison_ids) - num_poison)
            return Outcome(tuple(poison_ids[start:start + num_poison]), args.max_tokens, None, is_poisoned=True)
        prompt, max_tokens = rng.choice(pool) if pool else fresh()
        hang_up = rng.randint(1, 4) if rng.random() < args.disconnect else None
        return Outcome(prompt, max_tokens, hang_up)

    gate = asyncio.Semaphore(args.concurrency)

    async def client(o: Outcome) -> Outcome:
        async with gate:
            return await stream_completion(port, model, o, args.request_timeout)

    # Warm-up at full concurrency with the load's own mix (poisoned prompts included: the longest prefill
    # chunks), so the baseline includes what the first batches of each shape allocate (kernel workspaces,
    # allocator arenas); what grows after it is what the requests leave behind.
    warm = [job(i) for i in range(args.warmup)]
    await asyncio.gather(*(client(Outcome(o.prompt, args.max_tokens, None, o.is_poisoned)) for o in warm))
    idle = await wait_idle(port, 30)
    base = {"rss_mib": rss_mib(pid), "kv_blocks_in_use": gauge(idle, "kvcore_kv_blocks_in_use"),
            "kv_blocks_total": gauge(idle, "kvcore_kv_blocks_total")}
    rounds: list[dict] = []
    health: list[tuple[int, str]] = []
    poller = asyncio.create_task(poll_health(port, health))
    while len(rounds) < args.rounds or sum(rd["wall_s"] for rd in rounds) < args.duration:
        jobs = [job(i) for i in range(args.requests)]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(client(o) for o in jobs))
        wall = time.perf_counter() - t0
        idle = await wait_idle(port, 30)
        rounds.append({"outcomes": done, "wall_s": wall, "rss_mib": rss_mib(pid),
                       "kv_blocks_in_use": gauge(idle, "kvcore_kv_blocks_in_use")})
    poller.cancel()
    # The oracle: every request again, alone.
    checked = mismatches = 0
    alone_cache: dict[tuple[str, int], str] = {}
    for o in [o for rd in rounds for o in rd["outcomes"]][: args.verify_limit]:
        if o.error is not None or o.is_poisoned:
            continue
        key = (o.prompt, o.max_tokens)
        if key not in alone_cache:
            ref = await stream_completion(port, model, Outcome(o.prompt, o.max_tokens, None), args.request_timeout)
            alone_cache[key] = ref.text if ref.error is None else f"<error {ref.error}>"
        ok = alone_cache[key].startswith(o.text) if o.hang_up_after is not None else o.text == alone_cache[key]
        checked += 1
        mismatches += not ok
    return {"base": base, "rounds": rounds, "checked": checked, "mismatches": mismatches, "health": health}


def report(args: argparse.Namespace, result: dict, server_log: str) -> tuple[dict, bool]:
    base, rounds = result["base"], result["rounds"]
    poisoned = [o for rd in rounds for o in rd["outcomes"] if o.is_poisoned]
    outcomes = [o for rd in rounds for o in rd["outcomes"] if not o.is_poisoned]
    completed = [o for o in outcomes if o.error is None and o.hang_up_after is None]
    hung_up = [o for o in outcomes if o.hang_up_after is not None and o.error is None]
    server_errors = [o for o in outcomes if o.error is not None]
    poison_unclean = [o for o in poisoned if not clean_nan_error(o)]
    unhealthy = [h for h in result["health"] if h[0] != 200]
    wall = sum(rd["wall_s"] for rd in rounds)
    ttft = [o.ttft for o in completed if o.ttft is not None]
    tpot = [o.tpot for o in completed if o.tpot is not None]
    tokens = sum(len(o.token_times) for o in outcomes)
    summary = {
        "requests": len(outcomes), "completed": len(completed), "disconnected": len(hung_up),
        "server_errors": len(server_errors), "first_errors": sorted({o.error for o in server_errors})[:3],
        "poisoned_requests": len(poisoned), "poisoned_failed_cleanly": len(poisoned) - len(poison_unclean),
        "poisoned_statuses": {str(k): n for k, n in sorted(Counter(o.status for o in poisoned).items())},
        "poisoned_errors": sorted({re.sub(r"\d+", "N", o.error or "no error") for o in poisoned})[:3],
        "health_checks": len(result["health"]), "health_not_200": len(unhealthy),
        "first_unhealthy": sorted({f"{s} {b[:200]}" for s, b in unhealthy})[:3],
        "server_log_tracebacks": server_log.count("Traceback"),
        "greedy_streams_checked": result["checked"], "greedy_mismatches": result["mismatches"],
        "requests_per_s": len(outcomes) / wall, "output_tokens_per_s": tokens / wall, "wall_s": wall,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
        "tpot_s": {f"p{q}": pct(tpot, q) for q in (50, 90, 99)},
        "kv_blocks_total": base["kv_blocks_total"], "kv_blocks_in_use_before": base["kv_blocks_in_use"],
        "kv_blocks_in_use_after": [rd["kv_blocks_in_use"] for rd in rounds],
        "rss_mib_after_warmup": base["rss_mib"], "rss_mib_after_each_round": [rd["rss_mib"] for rd in rounds],
    }
    rss_growth = max(summary["rss_mib_after_each_round"]) - base["rss_mib"]
    ok = (not server_errors and not poison_unclean and not unhealthy and result["mismatches"] == 0
          and all(v == 0 for v in summary["kv_blocks_in_use_after"]) and rss_growth <= args.rss_tolerance_mib
          and summary["server_log_tracebacks"] == 0)
    summary["rss_growth_mib"] = rss_growth
    summary["passed"] = ok
    return summary, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tests/data/tiny-llama")
    p.add_argument("--served-model-name", default="load-test")
    p.add_argument("--requests", type=int, default=300, help="requests per round")
    p.add_argument("--rounds", type=int, default=1, help="repeat the load (RSS after each round is reported)")
    p.add_argument("--warmup", type=int, default=64, help="requests of the uncounted warm-up round")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=64, help="output lengths are uniform in [1, this]")
    p.add_argument("--disconnect", type=float, default=0.10, help="fraction of clients that hang up mid-stream")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--duration", type=float, default=0.0,
                   help="run rounds (at least --rounds) until the load has run this many seconds: a soak")
    p.add_argument("--prompt-pool", type=int, default=0,
                   help="draw requests from this many (prompt, length) pairs, each checked alone once; 0: all fresh")
    p.add_argument("--nan-fraction", type=float, default=0.0,
                   help="fraction of requests whose keys and values the server's test backend turns to NaN")
    p.add_argument("--nan-prompt-tokens", type=int, default=256,
                   help="a poisoned request's prompt length, its mark: more tokens than any other request reaches")
    p.add_argument("--nan-inner", default="cpu_decode", help="the backend the NaN test server runs every request on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-limit", type=int, default=10**9, help="check at most this many streams alone")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--time-limit", type=float, default=1200.0, help="seconds for the whole run")
    p.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `kvcore serve` argument (repeatable)")
    p.add_argument("--json", default=None,
                   help="also write the summary into this JSON file, under --json-key (other runs kept)")
    p.add_argument("--json-key", default=None, help="the summary's key in --json (default: the model)")
    args = p.parse_args(argv)

    machine = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
               "num_cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    log = tempfile.NamedTemporaryFile("w+", prefix="kvcore-serve-", suffix=".log", delete=False)
    launcher = ["-m", "kvcore.cli"] if not args.nan_fraction else [
        str(Path(__file__).with_name("nan_server.py")), "--nan-prompt-tokens", str(args.nan_prompt_tokens),
        "--nan-inner", args.nan_inner]
    cmd = [sys.executable, *launcher, "serve", "--model", args.model, "--host", HOST, "--port", "0",
           "--served-model-name", args.served_model_name, "--max-num-seqs", str(args.max_num_seqs),
           "--log-level", "warning", *args.server_arg]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=log, text=True)
    result = None
    try:
        line = server.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if not match:
            print(f"load_test: the server did not start: {line.strip()}", file=sys.stderr)
            return 1
        port = int(match.group(1))
        # keep reading the server's log, so a full pipe never blocks it
        threading.Thread(target=lambda: log.writelines(server.stderr), daemon=True).start()
        result = asyncio.run(asyncio.wait_for(run(args, port, server.pid), args.time_limit))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        print(f"load_test: server log: {log.name}", file=sys.stderr)
    log.flush()
    summary, ok = report(args, result, Path(log.name).read_text(errors="replace"))
    args_given = argv if argv is not None else sys.argv[1:]
    summary["command"] = shlex.join(["python", "benchmarks/studies/load_test.py", *args_given])
    summary.update(machine, load_average_after=os.getloadavg())
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.is_file() else {}
        runs[args.json_key or args.model] = summary
        path.write_text(json.dumps(runs, indent=2) + "\n")
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("KVCORE_LOAD_PLUGINS", "")
    sys.exit(main())

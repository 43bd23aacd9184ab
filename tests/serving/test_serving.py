"""`kvcore serve` as an OpenAI client meets it: the official `openai` package, unmodified, against a real
uvicorn server on a free loopback port (the tiny random model; one SmolLM2 test against `kvcore generate`)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.serving import AsyncEngine, build_app
from kvcore.serving.openai_api import MAX_REQUEST_BYTES
from kvcore.serving.server import ServerThread
from kvcore.text.chat_template import MAX_TEMPLATE_CHARS

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"
NAME = "tiny"
TIMEOUT = 30  # seconds for any single client call


def tiny_engine(**config) -> Engine:
    return Engine.from_pretrained(str(TINY), EngineConfig(backend="paged", **config))


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    front = AsyncEngine(tiny_engine(max_num_seqs=8))
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        srv.front = front
        yield srv
    assert not front._thread.is_alive()  # the app's shutdown stopped the engine loop


@pytest.fixture(scope="module")
def reference():
    """The same model in its own engine, one request at a time: what each request must produce alone."""
    engine = tiny_engine(max_num_seqs=1)

    def run(prompt_ids: list[int], max_tokens: int, **params):
        return engine.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens, **params))[0]

    run.engine = engine
    return run


def client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         timeout=TIMEOUT, **kw)


def post(srv, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    """A raw HTTP call (status, headers, JSON body): what error bodies look like on the wire."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, dict(resp.getheaders()), payload


def wait_idle(front: AsyncEngine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = front.stats
        if s.num_kv_blocks_used == 0 and s.num_requests_tracked == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        time.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {front.stats}")


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)


def test_completions_and_chat_through_the_openai_client(server, reference):
    c = client(server)
    tok = reference.engine.tokenizer
    prompt = "The quick brown fox"
    ref = reference(tok.encode(prompt), 12, ignore_eos=True)
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == NAME
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    # token ids as the prompt, streamed: the chunks add up to the same text
    chunks = list(c.completions.create(model=NAME, prompt=tok.encode(prompt), max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ref = reference(chat_ids(reference.engine, messages), 10, ignore_eos=True)
    out = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == 10
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    deltas = [ch.choices[0].delta for ch in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == ref.text
    assert [m.id for m in c.models.list().data] == [NAME] and c.models.retrieve(NAME).id == NAME
    # without max_tokens a chat request may use the whole context window left after its prompt
    out = c.chat.completions.create(model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == reference.engine.max_model_len
    assert out.choices[0].finish_reason == "length"


def test_concurrent_streams_each_equal_to_the_request_alone(server, reference):
    """Many clients at once, prompts and lengths of all sizes: no stream is corrupted by another."""
    rng = random.Random(0)
    tok = reference.engine.tokenizer
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    jobs = [(" ".join(rng.choices(words, k=rng.randint(1, 30))), rng.randint(1, 24)) for _ in range(24)]

    async def one(c: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in jobs))

    texts = asyncio.run(all_at_once())
    for (prompt, n), text in zip(jobs, texts):
        assert text == reference(tok.encode(prompt), n, ignore_eos=True).text, prompt
    wait_idle(server.front)


def test_error_bodies_and_codes(server):
    def check(body, status, code=None, path="/v1/completions", needle=""):
        got, _, payload = post(server, path, body)
        err = payload["error"]
        assert got == status and set(err) == {"message", "type", "param", "code"}, payload
        assert err["code"] == code and needle in err["message"], payload
        return err

    check(b"{not json", 400, needle="not valid JSON")
    check([1, 2], 400, needle="JSON object")
    check({"prompt": "hi", "temperature": "hot"}, 400, needle="temperature")
    check({"prompt": "hi", "temperature": 3}, 400, needle="temperature")
    check({"prompt": "hi", "max_tokens": 0}, 400, needle="max_tokens")
    check({"prompt": ""}, 400, needle="prompt")
    check({"prompt": [1, 2, 10**6]}, 400, needle="prompt")
    check({"prompt": "hi", "logprobs": 21}, 400, needle="logprobs")
    check({"prompt": "hi", "logit_bias": {"x": 1}}, 400, needle="logit_bias")
    check({"prompt": "hi", "stop": ["a"] * 5}, 400, needle="stop")
    check({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, needle="stream_options")
    check({"prompt": "hi", "suffix": "x"}, 400, needle="suffix")
    err = check({"prompt": "hi", "max_tokens": 1000}, 400, "context_length_exceeded")
    assert "256" in err["message"]  # the limit is named
    err = check({"prompt": [5] * 300}, 400, "context_length_exceeded")
    assert "256" in err["message"]
    check({"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", needle="gpt-4")
    check(b" " * (MAX_REQUEST_BYTES + 1), 413, "request_too_large", needle=str(MAX_REQUEST_BYTES))
    # text that could never fit is refused from its length, before the template renders it or it is tokenised
    long = "x" * 20_000  # the tiny model's tokens have at most 8 characters: 256 tokens hold far fewer
    check({"messages": [{"role": "user", "content": long}]}, 400, "context_length_exceeded",
          path="/v1/chat/completions", needle="characters")
    check({"prompt": long}, 400, "context_length_exceeded", needle="characters")
    huge = {"messages": [{"role": "user", "content": "x" * (MAX_TEMPLATE_CHARS // 2)}] * 3}  # not even parsed
    check(huge, 400, "context_length_exceeded", path="/v1/chat/completions", needle="bytes")
    check({"messages": []}, 400, path="/v1/chat/completions", needle="messages")
    check({"messages": [{"role": "user", "content": 5}]}, 400, path="/v1/chat/completions", needle="content")
    check({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
          path="/v1/chat/completions", needle="tools")
    check({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, path="/v1/chat/completions",
          needle="logprobs")
    # the official client maps them to its typed exceptions
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model=NAME, prompt="hi", max_tokens=5000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # and the server still serves
    assert client(server).completions.create(model=NAME, prompt="ok", max_tokens=2).usage.completion_tokens >= 1
    wait_idle(server.front)


def test_api_key_guards_v1_but_not_health():
    front = AsyncEngine(tiny_engine(max_num_seqs=2))
    with ServerThread(build_app(front, model_name=NAME, api_key="s3cret")) as srv:
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").models.list()
        status, _, body = post(srv, "/v1/completions", {"prompt": "hi"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert client(srv, api_key="s3cret").completions.create(model=NAME, prompt="hi", max_tokens=2).choices
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200


def test_queue_full_is_429_with_retry_after_and_the_running_request_is_unharmed(reference):
    front = AsyncEngine(tiny_engine(max_num_seqs=1), max_queue_len=0)  # one request in flight at most
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        c = client(srv)
        tok = reference.engine.tokenizer
        stream = c.completions.create(model=NAME, prompt="long one", max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        first = next(iter(stream))  # the first request is running
        status, headers, body = post(srv, "/v1/completions", {"prompt": "second"})
        assert status == 429 and int(headers["retry-after"]) >= 1 and body["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream)
        assert text == reference(tok.encode("long one"), 200, ignore_eos=True).text
        assert c.completions.create(model=NAME, prompt="now", max_tokens=2).choices  # room again


def _open_stream(srv, body: dict) -> socket.socket:
    """Start a request on a raw socket (so the test can hang up whenever it likes)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, stream, monkeypatch):
    front = server.front
    real_step = front.engine.step
    monkeypatch.setattr(front.engine, "step", lambda: (time.sleep(0.005), real_step())[1])  # a slower model
    aborted = front.metrics.request_finished.value(status="abort")
    tokens = front.metrics.generation_tokens.value()
    sock = _open_stream(server, {"prompt": "hang up on me", "max_tokens": 240, "temperature": 0,
                                 "stream": stream, "ignore_eos": True})
    deadline = time.monotonic() + TIMEOUT
    while front.metrics.generation_tokens.value() < tokens + 5:  # it is generating
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    idle = wait_idle(front)
    assert idle.num_kv_blocks_used == 0
    assert front.metrics.request_finished.value(status="abort") == aborted + 1
    assert front.metrics.generation_tokens.value() - tokens < 240  # stopped early


def test_n_choices_and_several_prompts(server, reference):
    c = client(server)
    tok = reference.engine.tokenizer
    out = c.completions.create(model=NAME, prompt=["one two", "three"], n=2, max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    texts = [reference(tok.encode(p), 6, ignore_eos=True).text for p in ("one two", "three")]
    assert [ch.text for ch in out.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert out.usage.completion_tokens == 24
    sampled = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=3,
                                        max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [ch.index for ch in sampled.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in sampled.choices}) > 1  # independent samples
    wait_idle(server.front)


def test_logprobs_and_stop_strings(server, reference):
    c = client(server)
    out = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token was chosen
    legacy = c.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 4
    for top, lp, token in zip(legacy.top_logprobs, legacy.token_logprobs, legacy.tokens):
        # keyed by token text: alternatives that decode alike (e.g. incomplete UTF-8 bytes, U+FFFD) share a key
        assert 1 <= len(top) <= 3 and lp <= 0 and top[token] >= lp, legacy
    assert legacy.text_offset == sorted(legacy.text_offset)
    streamed = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True})
    tokens = [e.token for ch in streamed if ch.choices and ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    echoed = c.completions.create(model=NAME, prompt="echo me", max_tokens=3, temperature=0, echo=True).choices[0]
    assert echoed.text.startswith("echo me")
    full = c.completions.create(model=NAME, prompt="stop here", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    # a stop string from the second half of the text (not U+FFFD, which stands for incomplete UTF-8 bytes)
    stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    cut = c.completions.create(model=NAME, prompt="stop here", max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_metrics_is_prometheus_text(server):
    client(server).completions.create(model=NAME, prompt="count me", max_tokens=4, temperature=0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    assert families["kvcore_time_to_first_token_seconds"].type == "histogram"
    assert families["kvcore_time_per_output_token_seconds"].type == "histogram"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert families["kvcore_generation_tokens"].type == "counter"  # the family drops "_total", samples keep it
    assert samples[("kvcore_generation_tokens_total", ())] >= 4
    assert samples[("kvcore_requests_total", (("status", "ok"),))] >= 1
    assert samples[("kvcore_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("kvcore_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == samples[
        ("kvcore_time_to_first_token_seconds_count", ())]
    assert samples[("kvcore_kv_blocks_total", ())] == server.front.engine.kv.blocks.num_blocks
    assert samples[("kvcore_prefill_tokens_total", ())] > 0 and samples[("kvcore_engine_steps_total", ())] > 0
    for name in ("kvcore_kv_blocks_in_use", "kvcore_num_requests_running", "kvcore_num_requests_waiting",
                 "kvcore_prefix_cache_hit_tokens_total"):
        assert (name, ()) in samples
    assert samples[("kvcore_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1


def test_kvcore_serve_command_end_to_end(tmp_path):
    """The real command in a subprocess: binds loopback, prints its port, serves, stops on Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore.cli", "serve", "--model", str(TINY), "--port", "0", "--api-key", "k",
         "--served-model-name", NAME, "--max-num-seqs", "4", "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "KVCORE_LOAD_PLUGINS": ""},
    )
    try:
        line = proc.stderr.readline()
        assert "kvcore: serving tiny on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split()[0]
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                out = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert out.choices[0].message.content is not None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
        proc.stderr.close()


@pytest.mark.slow
def test_smollm2_greedy_through_the_server_equals_kvcore_generate(capsys, smollm2, monkeypatch):
    import kvcore.loaders.model_cache
    from kvcore.cli import main
    from kvcore.model.decoder import LlamaModel

    # read the GGUF file once per session
    monkeypatch.setattr(kvcore.loaders.model_cache, "load_model", lambda name, **kw: smollm2)
    prompt = "The capital of France is"
    assert main(["generate", "--dtype", "float32", "--max-new-tokens", "16", "--json", prompt]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model = LlamaModel.from_weights(smollm2.config, smollm2.weights, torch.float32)
    front = AsyncEngine(Engine(model, smollm2.tokenizer, EngineConfig(max_num_seqs=4, dtype="float32")))
    with ServerThread(build_app(front, model_name="smollm2")) as srv:
        out = client(srv).completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.usage.completion_tokens == len(expected["token_ids"])


def test_load_test_script_small_run(tmp_path):
    """benchmarks/studies/load_test.py, bounded small: concurrent streams, hang-ups, the alone oracle, no leaks."""
    script = Path(__file__).parents[2] / "benchmarks" / "studies" / "load_test.py"
    out = tmp_path / "summary.json"
    argv = ["--model", str(TINY), "--requests", "24", "--concurrency", "8", "--max-tokens", "12",
            "--disconnect", "0.25", "--warmup", "8", "--time-limit", "120", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=180)
    rc = proc.returncode
    summary = json.loads(out.read_text())[str(TINY)]  # the file keeps one run per model
    assert rc == 0 and summary["passed"], (summary, proc.stderr[-2000:])
    assert summary["server_errors"] == 0 and summary["greedy_mismatches"] == 0 and summary["disconnected"] > 0
    assert summary["kv_blocks_in_use_after"] == [0]


def test_load_test_script_with_nan_requests_mixed_in(tmp_path):
    """load_test.py --nan-fraction, bounded small: requests whose keys and values turn NaN in the server's test
    backend each fail with a clean error, and every other stream still equals its run alone, /health stays 200,
    no block stays in use."""
    script = Path(__file__).parents[2] / "benchmarks" / "studies" / "load_test.py"
    out = tmp_path / "summary.json"
    # four slots for eight clients: a slot a poisoned request held is soon given to another one, which then
    # decodes beside longer ones (sdpa reads every slot up to the longest: a stale NaN there would spread)
    argv = ["--model", str(TINY), "--requests", "48", "--concurrency", "8", "--max-num-seqs", "4", "--max-tokens", "12",
            "--max-prompt-words", "8", "--nan-fraction", "0.25", "--nan-prompt-tokens", "200", "--nan-inner", "sdpa",
            "--prompt-pool", "16", "--warmup", "8", "--rounds", "2", "--time-limit", "120", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=180)
    summary = json.loads(out.read_text())[str(TINY)]
    assert proc.returncode == 0 and summary["passed"], (summary, proc.stderr[-2000:])
    assert summary["poisoned_requests"] > 0 and summary["poisoned_failed_cleanly"] == summary["poisoned_requests"]
    assert summary["server_errors"] == 0 and summary["greedy_mismatches"] == 0 and summary["completed"] > 0
    assert summary["health_checks"] > 0 and summary["health_not_200"] == 0
    assert summary["kv_blocks_in_use_after"] == [0, 0]


def test_prefix_cache_hits_show_in_usage_and_metrics():
    front = AsyncEngine(tiny_engine(max_num_seqs=2, enable_prefix_caching=True))
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        c = client(srv)
        prompt = list(range(3, 83))  # 80 tokens: 5 full blocks of 16
        first = c.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
        again = c.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details is None or not first.usage.prompt_tokens_details.cached_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
        assert again.choices[0].text == first.choices[0].text
        text = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
        text.request("GET", "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(text.getresponse().read().decode())}
        assert families["kvcore_prefix_cache_hit_tokens"].samples[0].value >= 64


def test_a_request_failing_mid_stream_ends_with_an_error_event_and_the_server_goes_on():
    engine = tiny_engine(max_num_seqs=2)
    real_step, calls = engine.step, {"n": 0}

    def step_failing_once():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("backend exploded")
        return real_step()

    engine.step = step_failing_once
    front = AsyncEngine(engine)
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "doomed", "max_tokens": 20, "stream": True,
                                                            "ignore_eos": True}), {"Content-Type": "application/json"})
        events = [e for e in conn.getresponse().read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "backend exploded" in error["message"] and error["code"] == "engine_error"
        with pytest.raises(openai.InternalServerError):  # mid-request failure, not streamed: a 5xx body
            engine.step, calls["n"] = step_failing_once, 0
            client(srv).completions.create(model=NAME, prompt="doomed too", max_tokens=20,
                                           extra_body={"ignore_eos": True})
        out = client(srv).completions.create(model=NAME, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        wait_idle(front)


def test_an_unexpected_error_adding_one_request_is_its_500_and_the_server_goes_on():
    engine = tiny_engine(max_num_seqs=2)
    real_add, calls = engine.add_request, []

    def add_failing_once(prompt, params=None, request_id=None):
        calls.append(request_id)
        if len(calls) == 1:
            raise RuntimeError("a plugin bug")
        return real_add(prompt, params, request_id)

    engine.add_request = add_failing_once
    front = AsyncEngine(engine)
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        with pytest.raises(openai.InternalServerError):
            client(srv).completions.create(model=NAME, prompt="doomed", max_tokens=3)
        out = client(srv).completions.create(model=NAME, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3 and front.error is None
        wait_idle(front)

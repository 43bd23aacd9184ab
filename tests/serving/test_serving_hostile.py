"""Hostile HTTP clients over loopback: no request makes the event loop do unbounded work, every bad body
is a 400 with OpenAI's error object, slow and vanishing clients cost nothing and are no server error."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvcore.serving.http as serving_http
import kvcore.serving.openai_api as openai_api
from kvcore import Engine, EngineConfig
from kvcore.serving import AsyncEngine, build_app
from kvcore.serving.server import ServerThread

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"
TIMEOUT = 30


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    front = AsyncEngine(Engine.from_pretrained(str(TINY), EngineConfig(backend="paged", max_num_seqs=4,
                                                                       enable_prefix_caching=True)))
    with ServerThread(build_app(front, model_name="tiny"), header_timeout_s=1.0) as srv:
        srv.front = front
        yield srv


def call(srv, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def metrics(srv) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


#: bounds with headroom for a loaded machine; tokenising the 15 MB prompt on the event loop took tens of seconds
REFUSAL_BOUND_S, HEALTH_BOUND_S = 2.0, 0.5


def test_a_15_mb_prompt_is_refused_fast_while_health_answers(server):
    prompt = "hello world " * (15_000_000 // 12)
    # encoded up front: the client shares the process (and its GIL) with the server under test
    bodies = [("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 4}).encode()),
              ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode())]
    health: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.perf_counter()
            status, _ = call(server, "GET", "/health")
            assert status == 200
            health.append(time.perf_counter() - t0)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    before = rss_bytes()
    poller.start()
    try:
        for _ in range(5):
            for path, data in bodies:
                t0 = time.perf_counter()
                status, body = call(server, "POST", path, data)
                elapsed = time.perf_counter() - t0
                assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
                assert elapsed < REFUSAL_BOUND_S, elapsed
    finally:
        done.set()
        poller.join()
    assert len(health) > 5 and max(health) < HEALTH_BOUND_S, max(health)
    del prompt, bodies
    # the client's own copies are gone again; what is left is the server's
    assert rss_bytes() - before < 100 * 2**20, (rss_bytes() - before) / 2**20


def test_a_prompt_just_past_the_character_bound_is_never_tokenised(server, monkeypatch):
    tokenizer = server.front.engine.tokenizer
    limit = 256 * tokenizer.max_token_chars * 4
    calls = []
    real = type(tokenizer).encode
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, text, add_bos=None: calls.append(len(text))
                        or real(self, text, add_bos))
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a" * (limit + 1)})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert str(limit) in body["error"]["message"] and calls == []
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a" * limit, "max_tokens": 1})
    assert calls == [limit]  # at the bound it is tokenised, and the token count decides
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_tokenize_and_detokenize_keep_the_completions_input_budget(server, monkeypatch):
    tokenizer, max_len = server.front.engine.tokenizer, server.front.engine.max_model_len
    limit = max_len * tokenizer.max_token_chars * 4  # what completions refuse past (protocol.max_prompt_chars)
    calls = []
    real_encode, real_template = type(tokenizer).encode, type(tokenizer).apply_chat_template
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, text, add_bos=None: calls.append(len(text))
                        or real_encode(self, text, add_bos))
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", lambda self, messages, **kw: calls.append(messages)
                        or real_template(self, messages, **kw))
    for body in ({"prompt": "a" * (limit + 1)}, {"messages": [{"role": "user", "content": "a" * limit}]}):
        status, payload = call(server, "POST", "/tokenize", body)
        assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
        assert str(limit) in payload["error"]["message"] and "\n" not in payload["error"]["message"]
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert calls == []  # refused before any tokenizer work
    status, payload = call(server, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and payload["count"] == len(payload["tokens"]) > 0
    status, payload = call(server, "POST", "/detokenize", {"tokens": [5] * (max_len + 1)})
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    assert str(max_len) in payload["error"]["message"]
    status, payload = call(server, "POST", "/detokenize", {"tokens": [5] * max_len})
    assert status == 200 and payload["prompt"]
    # a body no request of this model can need is refused unparsed here too (read_body's bound)
    status, payload = call(server, "POST", "/tokenize", json.dumps({"prompt": "hi " * 5_000_000}).encode())
    assert status == 400 and "bytes" in payload["error"]["message"], payload


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "hi", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "hi", "cache_salt": 5}, "cache_salt"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b"[" + b"{}," * 1_000_000 + b"{}]", "bytes"),  # a body no request of this model can need: not parsed
])
def test_bad_bodies_are_400(server, body, needle):
    status, payload = call(server, "POST", "/v1/completions", body)
    assert status == 400 and needle in payload["error"]["message"], payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_a_body_of_many_tiny_containers_is_refused_unparsed(server, monkeypatch):
    monkeypatch.setattr(serving_http, "MAX_JSON_CONTAINERS", 1000)  # where the body is decoded
    status, payload = call(server, "POST", "/v1/completions", b'{"prompt": [' + b"[]," * 1000 + b'[]]}')
    assert status == 400 and "more than 1000" in payload["error"]["message"], payload
    status, _ = call(server, "POST", "/v1/completions", {"prompt": "{" * 100 + "[" * 50, "max_tokens": 1})
    assert status == 200  # under the bound, brackets in a prompt are fine


def test_cache_salt_over_http(server):
    prompt = list(range(3, 83))  # 5 full blocks of 16

    def cached(**extra) -> int:
        status, body = call(server, "POST", "/v1/completions",
                            {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
        assert status == 200, body
        return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="bob") == 0
    assert cached() == 0
    assert cached(cache_salt="alice") >= 64


def test_slow_headers_are_disconnected(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
    t0 = time.perf_counter()
    assert sock.recv(100) == b""  # closed by the server
    assert time.perf_counter() - t0 < 5
    sock.close()
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # sends nothing at all
    assert idle.recv(100) == b""
    idle.close()
    assert call(server, "GET", "/health")[0] == 200


def test_a_slow_body_is_408(server, monkeypatch):
    monkeypatch.setattr(openai_api, "BODY_TIMEOUT_S", 0.5)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    reply = b""
    while b"}}" not in reply and (chunk := sock.recv(4096)):
        reply += chunk
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


def test_a_client_hanging_up_is_an_abort_not_a_server_error(server, caplog, monkeypatch):
    step = server.front.engine.step

    def slow_step():  # the tiny model could finish its 200 tokens before the client hangs up
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(server.front.engine, "step", slow_step)
    before = metrics(server)
    with caplog.at_level(logging.WARNING):
        # mid-body: the server never gets the whole request
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        time.sleep(0.2)
        sock.close()
        # mid-generation, not streaming
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        data = json.dumps({"prompt": "tell me", "max_tokens": 200, "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        time.sleep(0.3)
        sock.close()
        key = ("kvcore_http_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
        abort = ("kvcore_requests_total", (("status", "abort"),))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = metrics(server)
            if after.get(key, 0) - before.get(key, 0) >= 2 and after.get(abort, 0) > before.get(abort, 0):
                break
            time.sleep(0.05)
    assert after[key] - before.get(key, 0) == 2
    server_errors = [k for k in after if k[0] == "kvcore_http_requests_total" and dict(k[1])["status"] == "500"]
    assert all(after[k] == before.get(k, 0) for k in server_errors)
    assert after.get(abort, 0) - before.get(abort, 0) == 1  # the one that reached the engine
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info], caplog.text


def post(srv, path: str, body: dict) -> tuple[int, dict, dict]:
    """``call`` with the response headers (lower-case names)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    raw = resp.read()
    conn.close()
    return resp.status, headers, json.loads(raw) if raw else {}


def test_cache_salt_is_a_known_field(server):
    """vLLM's cache_salt is read (prefix-cache isolation), so it is neither reported as ignored nor refused
    by --strict."""
    from kvcore.serving.protocol import parse_completion

    status, headers, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": "t1"})
    assert status == 200 and "kvcore-ignored-fields" not in headers, (headers, body)
    engine = server.front.engine
    job = parse_completion({"prompt": "hi", "cache_salt": "t1"}, engine.tokenizer, strict=True,
                           vocab_size=engine.model.config.vocab_size, max_model_len=256, max_prompt_chars=10_000)
    assert job.params.cache_salt == "t1" and job.ignored_fields == ()


def test_unknown_field_names_cannot_forge_log_lines_or_break_the_answer(server, caplog):
    """A field name with control characters is escaped in the log line and the header (a raw newline in a
    header dropped the answer with a traceback; in the log it wrote a line of the client's choosing)."""
    forged = "x\nkvcore.serving.openai_api WARNING: admin logged in"
    body = {"prompt": "hi", "max_tokens": 1, forged: 1, "a\r\nSet-Cookie: s=1": 2, "t\tab\x00\x1b[31m": 3}
    with caplog.at_level(logging.WARNING):
        status, headers, payload = post(server, "/v1/completions", body)
    assert status == 200 and payload["choices"], payload
    shown = headers["kvcore-ignored-fields"]
    assert "set-cookie" not in headers and shown.isascii() and shown.isprintable(), shown
    assert "a\\r\\nSet-Cookie: s=1" in shown and "x\\nkvcore.serving" in shown and "t\\tab\\x00\\x1b[31m" in shown
    lines = [r.getMessage() for r in caplog.records if "not known" in r.getMessage()]
    assert len(lines) == 1 and lines[0].isprintable() and "\\n" in lines[0], lines
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    # a thousand long names: the header and the log line stay short, saying how many were left out
    many = {f"{'n' * 200}{i}": i for i in range(1000)}
    status, headers, _ = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **many})
    assert status == 200 and len(headers["kvcore-ignored-fields"]) < 2000
    assert headers["kvcore-ignored-fields"].endswith("and 984 more")


def test_a_guided_choice_of_ten_thousand_strings_works_as_the_enum_does(server):
    """The choices are one lexeme, as a JSON enum's values are: one grammar rule per string made the parser's
    first row 10,001 items (llguidance stops at 2000) and the request failed at its first token."""
    words = [f"w{i}x" for i in range(10_000)]
    for field, extra in (("guided_choice", words), ("guided_json", {"enum": words})):
        status, _, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 16, field: extra})
        assert status == 200, body
        text = body["choices"][0]["text"]
        assert (text if field == "guided_choice" else json.loads(text)) in words and body["choices"][0][
            "finish_reason"] == "stop", body


@pytest.mark.parametrize(("field", "value", "says"), [
    ("guided_regex", "[^\\s\\S]", "'guided_regex': regex: no text can match it"),
    ("guided_grammar", "start: /[^\\s\\S]/", "'guided_grammar': grammar: no text can match it"),
    ("guided_json", {"type": "integer", "minimum": 5, "maximum": 3}, "minimum (5) is greater than maximum (3)"),
    ("guided_json", {"type": "string", "minLength": 5, "maxLength": 3}, "minLength (5) is greater than maxLength"),
])
def test_a_constraint_nothing_satisfies_is_400_before_any_work(server, field, value, says):
    """A constraint no text matches was an empty answer with status 200 and finish_reason "stop"."""
    before = server.front.engine.stats.num_generated_tokens
    status, _, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, field: value})
    assert status == 400 and says in body["error"]["message"] and body["error"]["param"] == field, body
    assert "\n" not in body["error"]["message"] and server.front.engine.stats.num_generated_tokens == before


def test_a_constraint_that_dead_ends_mid_output_or_outgrows_max_tokens_never_ends_as_stop(server):
    """A grammar with no way on after its first token is a 400 (it ended as a complete "stop" answer); one that
    only needs more tokens than max_tokens allows is a 200 cut short with finish_reason "length"."""
    grammar = 'start: "a" b\nb: /[^\\s\\S]/'
    status, _, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "guided_grammar": grammar})
    assert status == 400 and "cannot be completed after 1 token: no text can match it" in body["error"]["message"]
    status, _, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_regex": "a{5}"})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["choices"][0]["text"] and "aaaaa".startswith(body["choices"][0]["text"]), body

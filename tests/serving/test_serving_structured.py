"""Structured output, tools, unknown fields and the small routes of `kvcore serve`, with the official `openai`
client against a real server (the tiny random model: a constraint, not the model, makes its output valid)."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from kvcore import Engine, EngineConfig
from kvcore.serving import AsyncEngine, build_app
from kvcore.serving.server import ServerThread, banner

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"
NAME = "tiny"
TIMEOUT = 120
USER = [{"role": "user", "content": "Describe a thing."}]


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    front = AsyncEngine(Engine.from_pretrained(str(TINY), EngineConfig(backend="paged", max_num_seqs=16)))
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def raw(srv, method: str, path: str, body=None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, headers, payload = resp.status, dict(resp.getheaders()), json.loads(resp.read())
    conn.close()
    return status, headers, payload


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A closed JSON schema: objects with required keys, enums, arrays with bounds, bounded numbers; an
    object at the top (what response_format takes)."""
    kinds = ["integer", "number", "enum", "string", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":  # a step bounds the digits: a random model never ends a free fraction on its own
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 50), 2),
                "multipleOf": rng.choice([0.5, 0.25, 0.125])}  # binary-exact: jsonschema checks in floats
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "teal", 3, None, True], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 2)}
    keys = rng.sample(["id", "name", "size", "color", "tags", "inner", "score", "ok"], rng.randint(1, 4 - depth))
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys}, "required": keys,
            "additionalProperties": False}


def test_fifty_random_schemas_validate_streaming_and_not_n_and_concurrent(server):
    rng = random.Random(2024)
    schemas = [random_schema(rng) for _ in range(50)]

    async def one(c: openai.AsyncOpenAI, i: int, schema: dict) -> list[str]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        n, stream = 1 + i % 2, i % 3 == 0
        args = dict(model=NAME, messages=USER, response_format=fmt, max_tokens=220, n=n, temperature=1.0, seed=i)
        if not stream:
            resp = await c.chat.completions.create(**args)
            assert all(ch.finish_reason == "stop" for ch in resp.choices), resp
            return [ch.message.content for ch in resp.choices]
        texts = [""] * n
        async for chunk in await c.chat.completions.create(**args, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        return texts

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(one(c, i, s) for i, s in enumerate(schemas)))

    outputs = asyncio.run(all_at_once())
    assert sum(len(o) for o in outputs) == 75
    for schema, texts in zip(schemas, outputs):
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_and_completions_response_format(server):
    c = client(server)
    resp = c.chat.completions.create(model=NAME, messages=USER, response_format={"type": "json_object"},
                                     max_tokens=200, temperature=0)
    text = resp.choices[0].message.content
    assert text.startswith("{") and (resp.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    resp = c.completions.create(model=NAME, prompt="JSON:", max_tokens=40,
                                extra_body={"response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "x", "schema": schema}}})
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


def test_vllm_guided_fields_match(server):
    c = client(server)
    pattern = r"[A-Z][a-z]{2,4} [0-9]{2}"
    for seed in range(3):
        resp = c.completions.create(model=NAME, prompt="Name and age:", max_tokens=30, temperature=1.0, seed=seed,
                                    extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, resp.choices[0].text), resp.choices[0].text
    choices = ["positive", "negative", "neutral"]
    resp = c.chat.completions.create(model=NAME, messages=USER, max_tokens=10, n=3, temperature=1.0, seed=1,
                                     extra_body={"guided_choice": choices})
    assert all(ch.message.content in choices for ch in resp.choices)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = c.chat.completions.create(model=NAME, messages=USER, max_tokens=20, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
    resp = c.chat.completions.create(model=NAME, messages=USER, max_tokens=20,
                                     extra_body={"guided_grammar": 'root ::= "v" [0-9] "." [0-9]'})
    assert re.fullmatch(r"v[0-9]\.[0-9]", resp.choices[0].message.content)
    resp = c.chat.completions.create(model=NAME, messages=USER, max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].message.content in ("yes", "no")


def test_malformed_structured_requests_are_400_naming_the_problem(server):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model=NAME, messages=USER, response_format=bad_schema)
    assert "objekt" in info.value.body["message"] and info.value.body["param"] == "response_format"
    for body, needle in [
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output field"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"guided_grammar": "root ::= missing"}, "grammar"),
    ]:
        status, _, payload = raw(server, "POST", "/v1/chat/completions", {"messages": USER, **body})
        assert status == 400 and needle in payload["error"]["message"], (body, payload)
        assert "\n" not in payload["error"]["message"]


def test_constraints_llguidance_cannot_read_are_400_and_the_server_serves_on(server):
    """Python's json reads Infinity and lone surrogate escapes, llguidance refuses them: the request's error,
    not the engine loop's (which once stopped serving every later request)."""
    infinite = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer",
                                                                              "maximum": float("inf")}}}
    for body, needle in [({"response_format": infinite}, "json schema"),
                         ({"guided_json": '{"type": "string", "const": "\\ud800"}'}, "json schema"),
                         ({"guided_regex": "\ud800"}, "regex")]:
        status, _, payload = raw(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})
        assert status == 400 and f"{needle}: " in payload["error"]["message"], (body, payload)
        status, _, payload = raw(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
        assert status == 200, payload


def test_text_no_header_or_utf_8_can_carry_is_escaped_not_a_500(server):
    status, headers, _ = raw(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "\u6e29": 1})
    assert status == 200 and headers["kvcore-ignored-fields"] == "\\u6e29"
    status, _, payload = raw(server, "POST", "/v1/completions", {"model": "\ud800", "prompt": "hi", "max_tokens": 1})
    assert status == 404 and payload["error"]["code"] == "model_not_found" and "\\ud800" in payload["error"]["message"]


def test_unknown_fields_are_logged_and_reported_or_refused_when_strict(server, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "zeta": True}
    with caplog.at_level("WARNING", logger="kvcore.serving.openai_api"):
        status, headers, _ = raw(server, "POST", "/v1/completions", body)
    assert status == 200 and headers["kvcore-ignored-fields"] == "frobnicate, zeta"
    assert any("frobnicate, zeta" in r.getMessage() for r in caplog.records)
    status, headers, _ = raw(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": "u"})
    assert status == 200 and "kvcore-ignored-fields" not in headers
    front = AsyncEngine(Engine.from_pretrained(str(TINY), EngineConfig(backend="paged")))
    with ServerThread(build_app(front, model_name=NAME, strict=True)) as strict:
        status, _, payload = raw(strict, "POST", "/v1/completions", body)
        assert status == 400 and payload["error"]["param"] == "frobnicate"
        assert "frobnicate, zeta" in payload["error"]["message"]
        status, _, _ = raw(strict, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200


def test_tokenize_detokenize_unknown_routes_and_models_card(server):
    tok_ids = client(server).completions.create(model=NAME, prompt="hello", max_tokens=1, echo=True)
    status, _, payload = raw(server, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and payload["count"] == len(payload["tokens"]) > 0 and payload["max_model_len"] == 256
    status, _, back = raw(server, "POST", "/detokenize", {"tokens": payload["tokens"]})
    assert status == 200 and back["prompt"] == "hello world"
    status, _, chat = raw(server, "POST", "/tokenize", {"messages": USER})
    assert status == 200 and chat["count"] > payload["count"]
    status, _, err = raw(server, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    for method, path, code in [("GET", "/v1/nothing", 404), ("POST", "/nope", 404), ("GET", "/v1/completions", 405)]:
        status, _, err = raw(server, method, path)
        assert status == code and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert path in err["error"]["message"]
    card = client(server).models.retrieve(NAME).model_dump()
    serving = card["serving"]
    assert serving["prefill_backend"] == serving["decode_backend"] == "paged"
    assert {"kv_cache", "sampler", "dtype", "weights"} <= set(serving) and serving["dtype"] == "float32"
    line = banner(serving)
    assert "backend paged" in line and f"kv_cache {serving['kv_cache']}" in line and "sampler default" in line
    assert serving["proposer"] is None and "speculative" not in line
    assert tok_ids.choices[0].text.startswith("hello")


def test_models_card_and_start_up_line_name_the_proposer():
    """With speculative decoding on, /v1/models and the start-up line say which proposer drafts, and how many."""
    engine = Engine.from_pretrained(str(TINY), EngineConfig(backend="sdpa", proposer="ngram", num_speculative_tokens=3))
    with ServerThread(build_app(AsyncEngine(engine), model_name=NAME)) as srv:
        status, _, card = raw(srv, "GET", f"/v1/models/{NAME}")
    assert status == 200
    assert card["serving"]["proposer"] == "ngram" and card["serving"]["num_speculative_tokens"] == 3
    assert banner(card["serving"]).endswith(", speculative ngram (3 drafts per step)")


TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Answer a call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>{{ eos_token }}\n"
    "{% endif %}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1,
                                                                           "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    model = tmp_path_factory.mktemp("tool-model")
    for f in TINY.iterdir():
        shutil.copy(f, model / f.name)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE,
                                                             "model_max_length": 2048}))
    # a longer window: the tool definitions alone outgrow the tiny model's 256 positions
    arch = json.loads((TINY / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**arch, "max_position_embeddings": 2048}))
    front = AsyncEngine(Engine.from_pretrained(str(model), EngineConfig(backend="paged", max_num_seqs=8)))
    with ServerThread(build_app(front, model_name=NAME)) as srv:
        srv.tokenizer = front.engine.tokenizer
        yield srv


def _check_calls(calls, allowed: dict) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_tool_calls_validate_against_their_schemas(tool_server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    c = client(tool_server)
    for seed in range(3):
        resp = c.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        _check_calls(choice.message.tool_calls, schemas)
    resp = c.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, TIME], max_tokens=200,
                                     tool_choice={"type": "function", "function": {"name": "get_time"}},
                                     parallel_tool_calls=False)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    for seed in range(4):  # "auto": a valid call, or a text answer that does not open one
        resp = c.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, TIME], max_tokens=60,
                                         parallel_tool_calls=False, temperature=1.0, seed=seed)
        message = resp.choices[0].message
        if message.tool_calls:
            _check_calls(message.tool_calls, schemas)
        else:
            assert not message.content.startswith("<"), message
    # streamed: the calls come as one delta at the end
    chunks = list(c.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    _check_calls(deltas, schemas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool definitions and the assistant's earlier call went through the template
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    status, _, payload = raw(tool_server, "POST", "/tokenize", {"messages": history})
    prompt = tool_server.tokenizer.decode(payload["tokens"], skip_special_tokens=False)
    assert '"name": "get_time"' in prompt and "12:00" in prompt
    resp = c.chat.completions.create(model=NAME, messages=history, tools=[WEATHER, TIME], max_tokens=30)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tools_on_a_template_without_tools_are_refused(server):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model=NAME, messages=USER, tools=[WEATHER])
    assert "chat template does not render tools" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=NAME, messages=USER, tool_choice="required")


SMOL_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer",
     "minimum": 0, "maximum": 130}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "temperature": {
        "type": "number", "minimum": -50, "maximum": 60}, "sky": {"enum": ["clear", "cloudy", "rain"]}},
     "required": ["city", "temperature", "sky"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
     "minItems": 2, "maxItems": 4}, "primary": {"type": "boolean"}}, "required": ["colours", "primary"],
     "additionalProperties": False},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "year"], "additionalProperties": False}}, "required": ["book"],
     "additionalProperties": False},
]


@pytest.mark.slow
def test_smollm2_json_schemas_streaming_and_not(smollm2):
    """A real model under real schemas (plain bounded numbers, no step): it ends the JSON itself."""
    from kvcore.model.decoder import LlamaModel

    model = LlamaModel.from_weights(smollm2.config, smollm2.weights, torch.float32)
    front = AsyncEngine(Engine(model, smollm2.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024)))
    prompts = ["Give a person as JSON.", "Give today's weather in a city as JSON.", "List some colours as JSON.",
               "Give a famous book as JSON."]
    with ServerThread(build_app(front, model_name="smollm2")) as srv:
        c = client(srv)
        for i, (schema, prompt) in enumerate(zip(SMOL_SCHEMAS, prompts)):
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            args = dict(model="smollm2", messages=[{"role": "user", "content": prompt}], response_format=fmt,
                        max_tokens=120, temperature=0)
            if i % 2:
                chunks = c.chat.completions.create(**args, stream=True)
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            else:
                resp = c.chat.completions.create(**args)
                assert resp.choices[0].finish_reason == "stop"
                text = resp.choices[0].message.content
            jsonschema.validate(json.loads(text), schema)

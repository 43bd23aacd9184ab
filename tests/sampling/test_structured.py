"""Constrained decoding (kvcore/sampling/structured.py) in the engine: every kind of constraint on the tiny random
model, the compile cache, the batched bitmask against a row-by-row reference, composition with samplers and n > 1,
and the everyday API (a string prompt, max_tokens, decoded tokens, Engine.chat)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams, StructuredOutput
from kvcore.errors import GrammarError, InvalidRequestError
from kvcore.sampling.sampler import DefaultSampler
from kvcore.sampling.structured import apply_grammar_masks

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 3, "maximum": 40},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["n", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.from_pretrained(str(TINY), EngineConfig(backend="paged", max_num_seqs=8))


def run(engine, structured, n=1, **params):
    params.setdefault("max_new_tokens", 120)
    return engine.generate("Hello there", SamplingParams(structured_output=structured, n=n, **params))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine, temperature):
    results = run(engine, StructuredOutput(json=SCHEMA), n=3, temperature=temperature, seed=7)
    assert len(results) == 3
    for r in results:
        assert r.finish_reason in ("stop", "eos"), r
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(engine):
    (r,) = run(engine, StructuredOutput(regex=r"[a-c]{2}-[0-9]{3}"), temperature=1.0, seed=1)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", r.text), r.text
    results = run(engine, StructuredOutput(choice=["alpha", "beta", "gamma"]), n=4, temperature=1.0, seed=2)
    assert all(r.text in ("alpha", "beta", "gamma") for r in results)
    (r,) = run(engine, StructuredOutput(grammar='root ::= "x" [0-9] [0-9] "!"'), temperature=1.0, seed=3)
    assert re.fullmatch(r"x[0-9]{2}!", r.text), r.text
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,3}/'
    (r,) = run(engine, StructuredOutput(grammar=lark), temperature=1.0, seed=4)
    assert re.fullmatch(r"<[a-z]{1,3}>", r.text), r.text
    (r,) = run(engine, StructuredOutput(json_object=True), max_new_tokens=200, temperature=0.0)
    if r.finish_reason != "length":
        assert isinstance(json.loads(r.text), dict)
    else:  # a random model may fill the budget: the prefix is still the start of an object
        assert r.text.startswith("{")


def test_unconstrained_rows_in_the_batch_are_untouched(engine):
    prompt = engine.tokenizer.encode("Hello there")
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    rows = [SamplingParams(max_new_tokens=12, ignore_eos=True),
            SamplingParams(max_new_tokens=40, structured_output=StructuredOutput(regex="[0-9]+!"))]
    mixed = engine.generate([prompt, prompt], rows)
    assert mixed[0].token_ids == free.token_ids  # the constrained neighbour changes nothing for it
    assert re.fullmatch(r"[0-9]+!", mixed[1].text) or mixed[1].finish_reason == "length"


def test_malformed_constraints_are_typed_errors(engine):
    with pytest.raises(GrammarError, match="strin"):
        run(engine, StructuredOutput(json={"type": "object", "properties": {"a": {"type": "strin"}}}))
    with pytest.raises(GrammarError, match="regex"):
        run(engine, StructuredOutput(regex="[a-"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        StructuredOutput(json="{oops")
    with pytest.raises(GrammarError):
        run(engine, StructuredOutput(grammar="root ::= undefined_rule"))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    assert GrammarError.exit_code == 2  # an invalid request, as every bad flag
    assert not engine.has_unfinished()


def test_compile_cache_is_keyed_by_the_full_grammar(engine):
    grammars = engine.grammars
    before = grammars.num_compiled
    # closed objects: a random model never stops writing an open one's extra keys
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
              "additionalProperties": False}
    run(engine, StructuredOutput(json=schema))
    run(engine, StructuredOutput(json=dict(schema)))  # equal text: compiled once
    assert grammars.num_compiled == before + 1
    other = {**schema, "properties": {"k": {"enum": ["a", "c"]}}}
    (r,) = run(engine, StructuredOutput(json=other), temperature=1.0, seed=11)
    assert grammars.num_compiled == before + 2 and json.loads(r.text)["k"] in ("a", "c")


def test_batched_mask_equals_row_by_row_reference(engine):
    """The one-call bitmask over the batch, expanded to the logits, allows exactly what each matcher's own
    single-row bitmask allows; every allowed token is one the matcher accepts. (llguidance may leave out a
    token it would accept where a longer token spells the same text: a canonical tokenisation.)"""
    grammars = engine.grammars
    matchers = [grammars.matcher(StructuredOutput(regex=r"[0-9]{2}x")),
                grammars.matcher(StructuredOutput(choice=["hello", "help"])), None,
                grammars.matcher(StructuredOutput(json=SCHEMA))]
    tok = engine.tokenizer
    matchers[0].consume_tokens(tok.encode("4"))

    class Row:
        def __init__(self, matcher):
            self.matcher = matcher

    vocab = engine.model.config.vocab_size
    logits = torch.randn(len(matchers), vocab)
    masked = logits.clone()
    apply_grammar_masks(masked, [Row(m) for m in matchers], grammars)
    for i, m in enumerate(matchers):
        if m is None:
            assert torch.equal(masked[i], logits[i])
            continue
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).astype(np.int64)
        allowed = torch.tensor([bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)])
        assert torch.equal(torch.isfinite(masked[i]), allowed), i
        assert torch.equal(masked[i][allowed], logits[i][allowed])
        assert allowed.any() and all(m.deep_copy().consume_token(t) for t in allowed.nonzero()[:, 0].tolist())


class MaskBlindSampler(DefaultSampler):
    """A planted bug: a sampler that picks the token the grammar forbids (the lowest logit)."""

    name = "mask-blind"

    def sample(self, logits, rows):
        return torch.nan_to_num(logits, neginf=1e9).argmax(-1)


def test_a_sampler_that_breaks_the_grammar_fails_only_that_request():
    eng = Engine.from_pretrained(str(TINY), EngineConfig(backend="paged"), sampler=MaskBlindSampler())
    (r,) = eng.generate("hi", SamplingParams(max_new_tokens=8, structured_output=StructuredOutput(regex="[0-9]+")))
    assert r.finish_reason == "error" and isinstance(r.error, GrammarError)
    (ok,) = eng.generate("hi", SamplingParams(max_new_tokens=3))
    assert ok.error is None and len(ok.token_ids) == 3


def test_string_prompt_max_tokens_alias_and_decoded_tokens(engine):
    one = engine.generate("Hello there", SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))
    assert len(one) == 1 and len(one[0].token_ids) == 5  # one prompt, not one per character
    r = one[0]
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    with pytest.raises(InvalidRequestError, match="disagree"):
        SamplingParams(max_tokens=5, max_new_tokens=9)
    tok = engine.tokenizer
    assert r.decoded_tokens == [tok.decode([t], skip_special_tokens=False) for t in r.token_ids]
    assert [len(a) for a in r.top_decoded_tokens] == [len(a) for a in r.top_logprobs]
    assert r.top_decoded_tokens[0][0] == tok.decode([r.top_logprobs[0][0][0]], skip_special_tokens=False)
    ids = engine.generate(tok.encode("Hello there"), SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(ids) == 1 and ids[0].token_ids == r.token_ids  # a flat id list is one prompt too


def test_engine_chat_uses_the_chat_template(engine):
    messages = [{"role": "user", "content": "hi"}]
    r = engine.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))
    tok = engine.tokenizer
    assert r.prompt_token_ids == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    assert len(r.token_ids) == 4

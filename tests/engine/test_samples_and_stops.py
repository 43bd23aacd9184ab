"""n > 1 samples sharing one prefill, stop strings, and logprobs through the engine."""

from __future__ import annotations

import pytest

from kvcore import Engine, EngineConfig, FinishReason, SamplingParams
from kvcore.errors import InvalidRequestError
from kvcore.text.outputs import StopStrings

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]  # 10 tokens: a partly filled last block of 4 or 16


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 12, "temperature": 0.9, "top_k": 40, "ignore_eos": True, **kw})


@pytest.mark.parametrize("backend, block_size", [("paged", 4), ("paged", 16), ("sdpa", 16)])
def test_n_samples_equal_single_requests_with_consecutive_seeds(random_model, backend, block_size):
    cfg = EngineConfig(backend=backend, block_size=block_size, max_model_len=64)
    singles = [Engine(random_model, None, cfg).generate([PROMPT], sampled(seed=7 + i))[0].token_ids for i in range(3)]
    engine = Engine(random_model, None, cfg)
    rid = engine.add_request(PROMPT, sampled(seed=7, n=3))
    ids = engine.sample_ids(rid)
    assert ids == [f"{rid}:0", f"{rid}:1", f"{rid}:2"]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for event in engine.step():
            streamed[event.request_id].append(event.token_id)
    results = [engine.release(i) for i in ids]
    assert [r.token_ids for r in results] == singles == [streamed[i] for i in ids]
    assert len({tuple(s) for s in singles}) == 3
    assert engine.stats.num_prefill_tokens == len(PROMPT)  # the prompt was computed once
    assert engine.stats.num_cached_tokens == 2 * len(PROMPT)
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    assert engine.sample_ids(rid) == [rid] and not engine._requests  # released: nothing left


def test_generate_and_stream_with_n(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    results = engine.generate([PROMPT, [4, 5]], [sampled(seed=1, n=2), sampled(seed=3)])
    assert len(results) == 3 and results[0].request_id.endswith(":0") and results[1].request_id.endswith(":1")
    greedy = engine.generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True, n=4))
    assert len({tuple(r.token_ids) for r in greedy}) == 1
    events = list(engine.stream(PROMPT, sampled(seed=1, n=2)))
    assert {e.request_id for e in events} == {"req-3:0", "req-3:1"} and not engine._requests


def test_n_samples_abort_and_limits(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="paged", max_model_len=64, max_num_seqs=4))
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        engine.add_request(PROMPT, sampled(n=5))
    rid = engine.add_request(PROMPT, sampled(n=3, seed=0))
    engine.step()
    engine.step()
    engine.abort(rid)
    assert all(engine.result(i).finish_reason is FinishReason.ABORT for i in engine.sample_ids(rid))
    assert engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(PROMPT, sampled(), request_id=f"{rid}:1")
    rid2 = engine.add_request(PROMPT, sampled(n=2, seed=0))  # aborted before its prefill: nothing ran
    engine.abort(rid2)
    assert not engine.has_unfinished()


def test_stop_string_search_holds_back_possible_starts():
    stops = StopStrings(("<end>", "XY"))
    assert stops.push("hello <e") == ("hello ", False)
    assert stops.push("n") == ("", False)
    assert stops.push("x!") == ("<enx!", False)
    assert stops.push("aX") == ("a", False)
    assert stops.push("Yzz") == ("", True)
    other = StopStrings(("é!",))
    assert other.push("caféé") == ("café", False) and other.push("!tail") == ("", True)


class CharTokenizer:
    """Token t is the character ``ALPHABET[t % len]``; enough of the tokenizer interface for the engine."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyzé "
    eos_token_ids = ()

    def encode(self, text: str) -> list[int]:
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.ALPHABET[t % len(self.ALPHABET)] for t in ids)

    def stream_decoder(self):
        tok = self

        class Decoder:
            def push(self, t: int) -> str:
                return tok.decode([t])

            def flush(self) -> str:
                return ""

        return Decoder()


def test_stop_strings_end_the_stream_before_the_stop_text(random_model):
    engine = Engine(random_model, CharTokenizer(), EngineConfig(backend="sdpa", max_model_len=64))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    full = engine.generate(["hello"], params)[0].text
    stop = full[9:12]
    cut = full.index(stop)
    res = engine.generate(["hello"], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop, "qqqqq"]))[0]
    assert res.finish_reason is FinishReason.STOP and res.text == full[:cut]
    assert len(res.token_ids) == cut + len(stop)  # the token that completed the stop string ended it
    streamed = "".join(e.text for e in engine.stream("hello", SamplingParams(max_new_tokens=30, ignore_eos=True,
                                                                            stop=stop)))
    assert streamed == full[:cut]
    unmatched = engine.generate(["hello"], SamplingParams(max_new_tokens=30, ignore_eos=True, stop="zzzzzz"))[0]
    assert unmatched.text == full and unmatched.finish_reason is FinishReason.LENGTH  # held-back text flushed
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        Engine(random_model, None, EngineConfig(backend="sdpa")).add_request([1, 2], SamplingParams(stop="x"))


def test_logprobs_in_events_and_results(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    events = list(engine.stream([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3)))
    assert all(e.logprob is not None and len(e.top_logprobs) == 3 for e in events)
    assert all(e.top_logprobs[0][0] == e.token_id and e.top_logprobs[0][1] == e.logprob for e in events)  # greedy
    res = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert res.logprobs == [e.logprob for e in events] and res.top_logprobs == [e.top_logprobs for e in events]
    plain = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0]
    assert plain.logprobs is None and plain.top_logprobs is None
    with pytest.raises(InvalidRequestError, match="logit_bias token id 300"):
        engine.add_request([1], SamplingParams(logit_bias={300: 1.0}))

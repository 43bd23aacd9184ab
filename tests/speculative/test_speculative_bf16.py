"""Speculative decoding on the fastest path (bfloat16 int4a8 fused layers, ``cpu_decode``, the int4 LM head) and on
the default one (float32 activations, the int8 head): a
verification row computes what the one-token step at its position computes, bit for bit, so greedy streams and
their logprobs are identical with speculation on and off. Contexts past one split-K chunk of the decode kernel
(256 keys), batches of several requests; planted differences (verification attention on the prefill kernel,
verification logits from the dense head) caught."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import make_random_model

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams, hookimpl
from kvcore.backends import cpu_decode
from kvcore.execution.runner import ModelRunner, position_logits
from kvcore.interfaces.proposer import Proposal, Proposer
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.loaders import expected_shapes
from kvcore.model.lm_head import RescoredInt4Head
from kvcore.plugins.registry import get_registry

pytestmark = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))

K = 8
NEW = 24


class Oracle(Proposer):
    """The stream without speculation, ``K`` tokens at a time: every draft must be kept."""

    name = "test-bf16-oracle"
    truth: dict[tuple[int, ...], list[int]] = {}

    def propose(self, rows, num_tokens):
        return [Proposal(self.truth[tuple(r.prompt_ids)][len(r.output_ids) :][:k]) for r, k in zip(rows, num_tokens)]


class _Plugin:
    @hookimpl
    def kvcore_register_proposers(self, register):
        register(Oracle)


@pytest.fixture(scope="module", autouse=True)
def oracle():
    name = get_registry().register_plugin(_Plugin(), name="test-bf16-oracle")
    try:
        yield
    finally:
        get_registry().unregister_plugin(name)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    """A random 2-layer int4a8 bfloat16 model whose vocabulary the int4 head takes (a multiple of 16)."""
    config = dataclasses.replace(make_random_model(num_layers=2, head_dim=64).config, vocab_size=512,
                                 intermediate_size=512, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=gen) * (0.3 if "embed" in name else shape[1] ** -0.5)
               if len(shape) == 2 else 1.0 + 0.1 * torch.randn(shape, generator=gen)
               for name, shape in expected_shapes(config).items()}
    return LlamaModel.from_weights(config, weights, torch.bfloat16, weight_format="int4a8")


def _prompts(num: int, length: int) -> list[list[int]]:
    """``num`` prompts of about ``length`` tokens: a random phrase repeated (n-grams for ``ngram`` to find)."""
    gen = torch.Generator().manual_seed(length)
    phrases = [torch.randint(3, 512, (29 + 4 * i,), generator=gen).tolist() for i in range(num)]
    return [(phrase * (length // len(phrase) + 1))[: length + 7 * i] for i, phrase in enumerate(phrases)]


def _generate(model, prompts, proposer=None):
    config = EngineConfig(backend="cpu_decode", dtype="bfloat16", lm_head="int4", max_model_len=512,
                          max_num_seqs=len(prompts), proposer=proposer, num_speculative_tokens=K)
    engine = Engine(model, None, config)
    assert engine.model.fused_layers and isinstance(engine.runner.head, RescoredInt4Head)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    return engine.generate(prompts, params)


def _differences(model, prompts, proposer: str) -> list[str]:
    """Where the streams with ``proposer`` differ from those without: tokens, logprobs (exactly), top logprobs."""
    base = _generate(model, prompts)
    Oracle.truth = {tuple(p): r.token_ids for p, r in zip(prompts, base)}
    spec = _generate(model, prompts, proposer)
    assert sum(r.metrics.num_spec_steps for r in spec) > 0, "speculation ran"
    out = []
    for i, (a, b) in enumerate(zip(base, spec)):
        for what in ("token_ids", "logprobs", "top_logprobs"):
            if getattr(a, what) != getattr(b, what):
                out.append(f"stream {i}: {what}")
        if proposer == Oracle.name and b.metrics.acceptance_rate != 1.0:
            out.append(f"stream {i}: acceptance {b.metrics.acceptance_rate}")
    return out


@pytest.mark.parametrize("proposer, num, length", [
    (Oracle.name, 1, 300), ("ngram", 1, 300), (Oracle.name, 3, 280),
    pytest.param(Oracle.name, 1, 60, marks=pytest.mark.slow), pytest.param("ngram", 3, 280, marks=pytest.mark.slow)])
def test_bf16_streams_identical_with_and_without_speculation(model, proposer, num, length):
    """One request past a split-K chunk boundary and three decoded together (27 verification rows: the int4 head in
    parts), against the same engine without speculation."""
    assert _differences(model, _prompts(num, length), proposer) == []


@pytest.mark.parametrize("bug", ["verification attention on the prefill kernel", "verification on the dense head"])
def test_a_planted_difference_is_caught(model, monkeypatch, bug):
    if bug.startswith("verification attention"):
        monkeypatch.setattr(cpu_decode, "SHORT_ROWS", 0)
    else:
        monkeypatch.setattr(ModelRunner, "forward_positions", lambda self, backend, cache, meta, ids, rows, num, *_:
                            position_logits(self.model, backend, cache, meta, ids, rows, num))
    found = _differences(model, _prompts(1, 300), Oracle.name)
    assert found and all("logprobs" in f or "token_ids" in f or "acceptance" in f for f in found), found


@pytest.mark.slow
def test_smollm2_default_engine_streams_identical_with_and_without_speculation():
    """The embedded SmolLM2 on kvcore's default configuration: the golden prompts decoded together, and a
    summary of a ~560-token passage (past two split-K chunks) alone, with n-gram speculation: the same tokens
    and logprobs as without."""
    base = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=1024, max_num_seqs=11))
    assert (base.config.dtype, base.config.weights, base.config.lm_head) == ("float32", "int4a8", "int8")
    spec = Engine(base.model, base.tokenizer, dataclasses.replace(base.config, proposer="ngram",
                                                                  num_speculative_tokens=K))
    golden = json.loads((Path(__file__).parents[1] / "data" / "golden_smollm2.json").read_text())
    passage = (Path(__file__).parents[2] / "docs" / "speculative.md").read_text()
    passage = passage.split("## How verification works")[1].split("## ")[0].strip()
    t = base.tokenizer
    summary = t.encode(t.apply_chat_template([{"role": "user", "content": f"Summarise the following text.\n\n"
                                                                          f"{passage}"}], add_generation_prompt=True))
    for prompts, new in (([p["prompt_token_ids"] for p in golden["prompts"]], 16), ([summary], 32)):
        params = SamplingParams(max_new_tokens=new, logprobs=1)
        a, b = base.generate(prompts, params), spec.generate(prompts, params)
        assert sum(r.metrics.num_accepted_tokens for r in b) > 0
        for x, y in zip(a, b):
            assert (x.token_ids, x.logprobs) == (y.token_ids, y.logprobs)


@pytest.mark.parametrize("options", [{}, {"num_layers": 1}], ids=["the target itself", "its first layer"])
def test_the_draft_model_runs_as_the_engine_runs_the_target(model, options):
    """The ``draft`` proposer's forward is the engine's: ``cpu_decode``, the fused layers' native stack (over a
    truncated draft's own layers only) and the target's int4 head, the prompt fed as the target's prefill ran it
    and the output as rows after the cache. So the target drafting for itself proposes its own greedy tokens, every
    one kept; with either draft the streams are those without speculation."""
    prompts = _prompts(2, 280)
    base = _generate(model, prompts)
    config = EngineConfig(backend="cpu_decode", dtype="bfloat16", lm_head="int4", max_model_len=512,
                          max_num_seqs=len(prompts), proposer="draft", num_speculative_tokens=4,
                          proposer_options={"draft": options})
    engine = Engine(model, None, config)
    proposer = engine.speculator.proposer
    assert isinstance(proposer.backend, cpu_decode.CPUDecodeBackend) and proposer.head is engine.runner.head
    spec = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2))
    assert [(r.token_ids, r.logprobs) for r in spec] == [(r.token_ids, r.logprobs) for r in base]
    assert sum(r.metrics.num_draft_tokens for r in spec) > 0
    if not options:
        assert [r.metrics.acceptance_rate for r in spec] == [1.0, 1.0]

"""The sampler interface and the default sampler: greedy, seeded streams that ignore their batch, the
sampled distribution (chi-square against ``softmax(logits / T)``), truncation, device, failures, and
what a custom sampler sees of each request."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Row, make_plugin

from kvcore import Engine, EngineConfig, FinishReason, SamplingParams
from kvcore.errors import SamplerError
from kvcore.interfaces.sampler import Sampler
from kvcore.plugins.registry import PluginRegistry
from kvcore.sampling.sampler import DefaultSampler, uniform_noise

V = 300  # vocabulary of the synthetic logits (the tiny test model's too)


def sampled(temperature=1.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, **kw)


def random_logits(rows: int, seed: int, vocab: int = V, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread


# -- greedy and truncation edge cases --------------------------------------------------------------------
def test_greedy_rows_are_argmax():
    sampler = DefaultSampler()
    logits = random_logits(6, seed=0)
    want = logits.argmax(-1)
    assert torch.equal(sampler.sample(logits.clone(), [Row(SamplingParams()) for _ in range(6)]), want)
    mixed = [Row(SamplingParams() if i % 2 else sampled(seed=i), seed=i) for i in range(6)]
    got = sampler.sample(logits.clone(), mixed)
    assert torch.equal(got[1::2], want[1::2])
    # greedy ignores seed, top-k and top-p
    rows = [Row(SamplingParams(top_k=5, top_p=0.5, seed=i), seed=i) for i in range(6)]
    assert torch.equal(sampler.sample(logits.clone(), rows), want)


def test_argmax_rows_equals_torch_argmax_on_ties_infinities_and_nan():
    """The blocked argmax behind greedy rows returns torch.argmax's index: the first maximum, a NaN as the
    largest, ties across and inside blocks, every block -inf, and vocabularies that are not a multiple of its
    256-logit blocks."""
    from kvcore.sampling.processors import argmax_rows

    logits = random_logits(8, seed=5, vocab=1024)
    logits[1, 700] = logits[1, 300] = 50.0  # tie across blocks: the first wins
    logits[2, 10] = logits[2, 11] = 50.0  # tie inside a block
    logits[3] = float("-inf")
    logits[4, 900] = float("nan")
    logits[5, 5], logits[5, 600] = float("nan"), float("inf")
    logits[6, 1023] = float("inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert argmax_rows(logits).tolist()[1:7] == [300, 10, 0, 900, 5, 1023]
    odd = random_logits(3, seed=6, vocab=V)  # 300: not a multiple of 256
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = random_logits(64, seed=1)
    rows = [
        Row(sampled(temperature=[0.3, 1.0, 2.5][i % 3], top_k=1, top_p=[1.0, 0.9][i % 2]), seed=i) for i in range(64)
    ]
    assert torch.equal(DefaultSampler().sample(logits.clone(), rows), logits.argmax(-1))


def test_tiny_top_p_keeps_the_top_token():
    logits = random_logits(64, seed=2)
    for top_p in (1e-46, 5e-324):  # below float32's smallest subnormal; the smallest positive double
        rows = [Row(sampled(temperature=1.5, top_p=top_p), seed=i, output_ids=[0] * i) for i in range(64)]
        assert torch.equal(DefaultSampler().sample(logits.clone(), rows), logits.argmax(-1))


def test_tiny_temperature_tends_to_greedy():
    logits = random_logits(16, seed=3)
    rows = [Row(sampled(temperature=1e-39), seed=i) for i in range(16)]
    assert torch.equal(DefaultSampler().sample(logits.clone(), rows), logits.argmax(-1))


# -- seeded streams ----------------------------------------------------------------------------------------
TARGET = sampled(temperature=0.9, top_k=50, top_p=0.9, seed=7)
STEPS = 24


def target_stream(params: SamplingParams, seed: int, neighbours=(), position: int = 0) -> list[int]:
    """The tokens of one row over ``STEPS`` steps, sampled in a batch with ``neighbours`` (params, seed)
    whose rows get their own random logits; the target's logits are the same in every batch."""
    sampler = DefaultSampler()
    target_logits = random_logits(STEPS, seed=10)
    noise = torch.Generator().manual_seed(1000 + len(neighbours))
    target = Row(params, seed, request_id="target")
    batch = [Row(p, s, request_id=f"n{i}") for i, (p, s) in enumerate(neighbours)]
    batch.insert(position, target)
    for step in range(STEPS):
        logits = torch.randn(len(batch), V, generator=noise) * 3
        logits[position] = target_logits[step]
        for row, token in zip(batch, sampler.sample(logits, batch).tolist()):
            row.output_ids.append(token)
    return target.output_ids


def test_seeded_stream_is_reproducible_and_independent_of_its_batch():
    alone = target_stream(TARGET, 7)
    assert alone == target_stream(TARGET, 7)
    assert len(set(alone)) > 5 and alone != random_logits(STEPS, seed=10).argmax(-1).tolist()  # really sampled
    neighbours = [(sampled(1.2, seed=8), 8), (SamplingParams(), 0), (sampled(0.7, top_p=0.5, seed=9), 9)]
    assert alone == target_stream(TARGET, 7, neighbours[:2], position=1)
    assert alone == target_stream(TARGET, 7, neighbours[1:], position=2)
    assert alone == target_stream(TARGET, 7, neighbours, position=0)


def test_different_seeds_give_different_streams():
    streams = {tuple(target_stream(TARGET, seed)) for seed in range(8)}
    assert len(streams) == 8


def test_uniform_noise_is_a_function_of_seed_and_step_only():
    u = uniform_noise([5, 9, 5], [3, 0, 4], V, torch.device("cpu"))
    assert u.shape == (3, V) and u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    assert torch.equal(u[0], uniform_noise([5], [3], V, torch.device("cpu"))[0])
    assert torch.equal(u[1], uniform_noise([1, 9], [1, 0], V, torch.device("cpu"))[1])
    assert not torch.equal(u[0], u[2])  # the same seed one step later
    assert abs(u.mean().item() - 0.5) < 0.05


# -- the sampled distribution ----------------------------------------------------------------------------
LOGITS5 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
NUM_SEEDS, NUM_STEPS = 100, 200  # 20,000 draws: every (seed, step) pair of a fixed grid, never re-picked
ALPHA = 1e-3  # a correct sampler fails one grid in a thousand; the grid is fixed, so the test is deterministic


def draw_counts(params: SamplingParams, logits: torch.Tensor = LOGITS5) -> torch.Tensor:
    """Token counts of one draw per (seed, step) of the grid, all rows in one sampler call."""
    rows = [Row(params, seed, output_ids=[0] * step) for seed in range(NUM_SEEDS) for step in range(NUM_STEPS)]
    tokens = DefaultSampler().sample(logits.expand(len(rows), -1).clone(), rows)
    return torch.bincount(tokens, minlength=logits.numel())


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): closed forms for df 1 and 2, then the recurrence
    ``Q(x; k + 2) = Q(x; k) + (x/2)^(k/2) e^(-x/2) / Gamma(k/2 + 1)`` (no scipy here)."""
    q = math.erfc(math.sqrt(x / 2)) if df % 2 else math.exp(-x / 2)
    for k in range(2 - df % 2, df, 2):
        q += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1))
    return q


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of ``counts`` over the tokens with ``probs > 0`` (which must hold them all)."""
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"drew filtered tokens: {counts.tolist()}"
    n = counts.sum().item()
    expected = probs[kept].double() * n
    assert expected.min() >= 5  # Pearson's approximation holds
    stat = ((counts[kept].double() - expected) ** 2 / expected).sum().item()
    return chi2_sf(stat, int(kept.sum()) - 1)


def test_chi2_sf_matches_tabulated_quantiles():
    # the 0.999 quantiles of chi-square with 1..4 degrees of freedom (standard tables)
    for df, quantile in [(1, 10.828), (2, 13.816), (3, 16.266), (4, 18.467)]:
        assert chi2_sf(quantile, df) == pytest.approx(1e-3, rel=1e-3)


def test_frequencies_match_softmax_with_temperature():
    counts = draw_counts(sampled(temperature=0.7))
    assert chi2_p_value(counts, (LOGITS5 / 0.7).softmax(-1)) > ALPHA
    # the same counts reject the untempered distribution: the check has the power to see a wrong temperature
    assert chi2_p_value(counts, LOGITS5.softmax(-1)) < 1e-6


def test_top_k_draws_only_kept_tokens_in_their_renormalised_proportions():
    counts = draw_counts(sampled(temperature=1.0, top_k=3))
    probs = LOGITS5.softmax(-1) * (torch.arange(5) < 3)
    assert chi2_p_value(counts, probs / probs.sum()) > ALPHA
    assert (counts[:3] > 0).all()


def test_top_p_draws_only_kept_tokens_in_their_renormalised_proportions():
    probs = LOGITS5.softmax(-1)  # [.563, .207, .126, .076, .028]: the tokens before the 3rd hold .770 < .8
    counts = draw_counts(sampled(temperature=1.0, top_p=0.8))
    kept = probs * (torch.arange(5) < 3)
    assert chi2_p_value(counts, kept / kept.sum()) > ALPHA
    # top-k then top-p on the renormalised top-k: [.579, .213, .129, .078], before the 3rd .792 >= .75
    counts = draw_counts(sampled(temperature=1.0, top_k=4, top_p=0.75))
    assert counts[2:].sum() == 0 and (counts[:2] > 0).all()


# -- devices ---------------------------------------------------------------------------------------------
DEVICES = [
    "cpu",
    # meta tensors have no data, and an op mixing one with a CPU tensor raises: everything the sampler
    # builds must be on the logits' device
    "meta",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_runs_on_the_logits_device_and_returns_int64_there(device):
    logits = random_logits(4, seed=4).to(device)
    for rows in (
        [Row(SamplingParams()) for _ in range(4)],
        [Row(sampled(top_k=[0, 5][i % 2], top_p=[1.0, 0.9][i // 2], seed=i), seed=i) for i in range(3)]
        + [Row(SamplingParams())],
    ):
        out = DefaultSampler().sample(logits.clone(), rows)
        assert out.shape == (4,) and out.dtype == torch.int64 and out.device == logits.device
        if device != "meta":  # a draw is the same on every device
            assert out.tolist() == DefaultSampler().sample(logits.cpu(), rows).tolist()


# -- through the engine ----------------------------------------------------------------------------------
def test_seeded_request_in_the_engine_ignores_its_batch(random_model):
    def generate(prompts, params):
        engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
        return [r.token_ids for r in engine.generate(prompts, params)]

    params = sampled(temperature=0.9, top_k=50, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True)
    alone = generate([[1, 2, 3]], params)[0]
    others = [
        sampled(temperature=1.2, seed=8, max_new_tokens=5, ignore_eos=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        sampled(temperature=0.7, top_p=0.5, seed=9, max_new_tokens=16, ignore_eos=True),
    ]
    batched = generate([[4, 5], [1, 2, 3], [6, 7, 8, 9]], [others[0], params, others[2]])
    assert batched[1] == alone
    assert generate([[1, 2, 3], [9]], [params, others[1]])[0] == alone
    greedy = generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert alone != greedy


class FragileSampler(DefaultSampler):
    name = "fragile"

    def sample(self, logits, rows):
        if any(r.request_id == "doomed" and len(r.output_ids) == 2 for r in rows):
            raise RuntimeError("boom")
        return super().sample(logits, rows)


GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _alone(model, prompt):
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_model_len=64))
    return engine.generate([prompt], GREEDY)[0].token_ids


def test_failing_sampler_fails_only_its_batch(random_model):
    # max_num_seqs=2: 'keep' and 'doomed' decode together, 'later' waits for a free place
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, max_num_seqs=2),
                    sampler=FragileSampler())
    for rid, prompt in [("keep", [1, 5, 9]), ("doomed", [7, 8]), ("later", [3, 4, 5, 6])]:
        engine.add_request(prompt, GREEDY, request_id=rid)
    failed = []
    while engine.has_unfinished():
        failed += [e for e in engine.step() if e.error is not None]
    assert sorted(e.request_id for e in failed) == ["doomed", "keep"]  # the batch the sampler failed on
    for rid in ("keep", "doomed"):
        res = engine.result(rid)
        assert res.finish_reason is FinishReason.ERROR and isinstance(res.error, SamplerError)
        assert "sampler 'fragile' failed: RuntimeError: boom" in str(res.error)
        assert len(res.token_ids) == 2
    assert engine.result("later").token_ids == _alone(random_model, [3, 4, 5, 6])
    assert engine.kv.blocks.num_tokens_in_use == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_failing_sampler_in_a_prefill_leaves_running_requests_alone(random_model, chunked):
    class FailsOnPrefillOf(DefaultSampler):
        name = "prefill-fragile"

        def sample(self, logits, rows):
            if any(r.request_id == "doomed" for r in rows):
                raise ValueError("bad row")
            return super().sample(logits, rows)

    config = EngineConfig(backend="sdpa", max_model_len=64, enable_chunked_prefill=chunked)
    engine = Engine(random_model, None, config, sampler=FailsOnPrefillOf())
    engine.add_request([1, 5, 9], GREEDY, request_id="keep")
    engine.step()
    engine.step()
    engine.add_request([7, 8], GREEDY, request_id="doomed")  # prefilled in the next step
    events = engine.step()
    # unchunked, the prefill runs alone; chunked, it shares the step with keep's decode, which the engine
    # then runs again without it, so keep still gets its token
    want = [("keep", None), ("doomed", FinishReason.ERROR)] if chunked else [("doomed", FinishReason.ERROR)]
    assert [(e.request_id, e.finish_reason) for e in events] == want
    events = events[-1:]
    assert isinstance(events[0].error, SamplerError) and "sampler 'prefill-fragile'" in str(events[0].error)
    while engine.has_unfinished():
        engine.step()
    assert engine.result("keep").token_ids == _alone(random_model, [1, 5, 9])
    assert engine.result("doomed").token_ids == []


class BrokenContractSampler(DefaultSampler):
    """Returns what the interface forbids: one id too few, or an id outside the vocabulary."""

    name = "broken-contract"

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def sample(self, logits, rows):
        ids = super().sample(logits, rows)
        return ids[:-1] if self.mode == "short" else ids + logits.shape[-1]


@pytest.mark.parametrize("mode", ["short", "out-of-vocab"])
def test_sampler_breaking_its_contract_is_a_sampler_error(random_model, mode):
    engine = Engine(
        random_model, None, EngineConfig(backend="sdpa", max_model_len=64), sampler=BrokenContractSampler(mode)
    )
    results = engine.generate([[1, 2, 3], [4, 5]], GREEDY)
    for res in results:
        assert isinstance(res.error, SamplerError) and "sampler 'broken-contract'" in str(res.error)
        assert res.token_ids == []  # no id the sampler was not allowed to return is handed out


class PresencePenaltySampler(Sampler):
    """Greedy after subtracting ``penalty`` from every token already in the row's prompt or output, and a
    record of every row it was shown."""

    name = "presence"

    def __init__(self, penalty: float = 0.0, **options) -> None:
        super().__init__(**options)
        self.penalty = penalty
        self.seen: list[tuple[str, list[int], list[int], SamplingParams, int]] = []

    def sample(self, logits, rows):
        for i, row in enumerate(rows):
            self.seen.append((row.request_id, list(row.prompt_ids), list(row.output_ids), row.params, row.seed))
            history = torch.tensor(row.prompt_ids + row.output_ids, device=logits.device)
            logits[i, history] -= self.penalty
        return logits.argmax(-1)


def test_custom_sampler_sees_each_request_and_its_growing_history(random_model):
    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(make_plugin(samplers=[PresencePenaltySampler]), name="penalty-plugin")
    config = EngineConfig(
        backend="sdpa", max_model_len=64, sampler="presence", sampler_options={"presence": {"penalty": 1e4}}
    )
    engine = Engine(random_model, None, config, registry=registry)
    sampler = engine.sampler
    assert isinstance(sampler, PresencePenaltySampler) and sampler.penalty == 1e4
    prompts = {"a": [1, 5, 9], "b": [7, 8, 7]}
    params = {"a": SamplingParams(max_new_tokens=16, ignore_eos=True, seed=1234),
              "b": SamplingParams(max_new_tokens=16, ignore_eos=True)}
    for rid in prompts:
        engine.add_request(prompts[rid], params[rid], request_id=rid)
    while engine.has_unfinished():
        engine.step()
    for rid in prompts:
        seen = [s for s in sampler.seen if s[0] == rid]
        out = engine.result(rid).token_ids
        assert [s[1] for s in seen] == [prompts[rid]] * 16
        assert [s[2] for s in seen] == [out[:i] for i in range(16)]  # the history grows one token per step
        assert all(s[3] is params[rid] for s in seen)
        assert len({s[4] for s in seen}) == 1 and isinstance(seen[0][4], int)
        assert not set(out) & set(prompts[rid]) and len(set(out)) == 16  # the penalty worked on the history
    assert sampler.seen[0][4] == 1234  # a seeded request's seed; an unseeded one gets a drawn one
    # without the penalty the same model repeats itself: the history is what made the difference
    plain = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    repeats = [r.token_ids for r in plain.generate(list(prompts.values()), list(params.values()))]
    assert any(len(set(s)) < 16 or set(s) & set(p) for s, p in zip(repeats, prompts.values()))

"""The backend boundary: a backend returning NaN, inf, a transposed result of the right size, the wrong dtype
or shape fails its batch with BackendOutputError (CLI exit 4) instead of producing wrong tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import make_plugin, registered

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.sdpa import SDPABackend
from kvcore.cli import main
from kvcore.errors import BackendOutputError, NonFiniteRowsError
from kvcore.execution.backend_check import reference_attention
from kvcore.plugins.registry import get_registry
from kvcore.scheduling.request import FinishReason

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def broken(out: torch.Tensor, mode: str):
    """``out [T, H, D]`` spoiled the way ``mode`` says."""
    if mode == "nan":  # the batch's last token: the last sequence only
        return out.clone().index_fill_(0, torch.tensor([out.shape[0] - 1]), float("nan"))
    if mode == "nan-all":
        return torch.full_like(out, float("nan"))
    if mode == "inf":
        spoiled = out.clone()
        spoiled[-1, 0, 0] = float("inf")
        return spoiled
    if mode == "transposed":  # [T, D, H] memory read as [T, H, D]: the right size, the wrong layout
        return out.transpose(1, 2).reshape(out.shape)
    if mode == "dtype":
        return out.double()
    if mode == "shape":
        return out.reshape(out.shape[0], -1)
    if mode == "not-a-tensor":
        return out.tolist()
    raise AssertionError(mode)


class PlantedBackend(SDPABackend):
    """sdpa, with its output spoiled in the forwards ``should_break(meta)`` picks."""

    name = "planted"
    mode = "nan"
    layer = 0

    def should_break(self, meta) -> bool:
        return True

    def plan(self, meta, cache):
        self._break = self.should_break(meta)
        return super().plan(meta, cache)

    def forward(self, layer_idx, q, k, v, cache, plan):
        out = super().forward(layer_idx, q, k, v, cache, plan)
        return broken(out, self.mode) if self._break and layer_idx == self.layer else out


def planted(mode: str, layer: int = 0, when=None) -> PlantedBackend:
    backend = type(f"Planted_{mode}", (PlantedBackend,), {"mode": mode, "layer": layer})()
    if when is not None:
        backend.should_break = when
    return backend


def engine_with(model, backend, decode_backend=None, **config) -> Engine:
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_model_len=64, **config))
    engine.prefill_backend = backend
    engine.decode_backend = decode_backend or backend
    from kvcore.execution.backend_check import BackendGuard

    engine.runner.guards = {id(b): BackendGuard(b) for b in (engine.prefill_backend, engine.decode_backend)}
    return engine


def _alone(model, prompt):
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_model_len=64))
    return engine.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("mode, message", [
    ("nan-all", "returned NaN or inf from forward (prefill"),
    ("transposed", "returned a wrong attention output (prefill, layer 0, sequence 1)"),
    ("dtype", "returned [6, 4, 16] float64 on cpu from forward at layer 0; the contract is [T, H, D] = [6, 4, 16] "
              "float32 on cpu"),
    ("shape", "returned [6, 64] float32 on cpu from forward at layer 0"),
    ("not-a-tensor", "returned list from forward, not a tensor (layer 0)"),
])
def test_broken_output_fails_the_batch_with_a_backend_error(random_model, mode, message):
    engine = engine_with(random_model, planted(mode))
    results = engine.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
    for res in results:
        assert res.finish_reason is FinishReason.ERROR and isinstance(res.error, BackendOutputError)
        assert f"backend 'planted' {message}" in str(res.error)
        assert res.token_ids == []  # no token 0 from NaN logits
    assert engine.kv.blocks.num_tokens_in_use == 0


@pytest.mark.parametrize("mode", ["nan", "inf"])
def test_a_non_finite_sequence_fails_alone(random_model, mode):
    engine = engine_with(random_model, planted(mode, when=lambda meta: not meta.is_decode))
    kept, spoiled = engine.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
    assert spoiled.finish_reason is FinishReason.ERROR and isinstance(spoiled.error, BackendOutputError)
    message = "backend 'planted' returned NaN or inf from forward (prefill, layer 0) (sequence 1 of 2"
    assert message in str(spoiled.error)
    assert spoiled.token_ids == []  # no token 0 from NaN logits
    assert kept.error is None and kept.token_ids == _alone(random_model, [1, 2, 3])
    assert engine.kv.blocks.num_tokens_in_use == 0


@pytest.mark.parametrize("layer", [0, 1])
def test_nan_in_a_decode_step_at_any_layer(random_model, layer):
    decode = planted("nan", layer=layer, when=lambda meta: max(meta.context_lens) >= 6)
    engine = engine_with(random_model, SDPABackend(), decode)
    res = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert isinstance(res.error, BackendOutputError) and "'planted' (decode" in str(res.error) or \
        "backend 'planted' returned NaN or inf from forward (decode, layer 0)" in str(res.error)
    # layer 1: caught in the logits, the message says so
    assert ("layer-0 output was finite" in str(res.error)) == (layer == 1)
    assert len(res.token_ids) == 4  # prefill + decodes at contexts 3, 4, 5; the one at context 6 broke


def test_transposed_decode_output_is_caught_on_the_first_decode(random_model):
    engine = engine_with(random_model, SDPABackend(), planted("transposed"))
    res = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert isinstance(res.error, BackendOutputError) and "wrong attention output (decode" in str(res.error)
    assert len(res.token_ids) == 1  # the prefill's token


@pytest.mark.parametrize("chunked", [False, True])
def test_a_broken_prefill_leaves_running_requests_alone(random_model, chunked):
    # breaks any prefill holding the 2-token prompt of 'doomed' (prefilled with 'later'); chunked, keep's decode
    # shares that forward, which the engine then runs again split by phase, so keep still gets its token
    prefill = planted("nan-all", when=lambda meta: 2 in meta.query_lens and max(meta.query_lens) > 1)
    engine = engine_with(random_model, prefill, SDPABackend(), enable_chunked_prefill=chunked)
    engine.add_request([1, 5, 9], GREEDY, request_id="keep")
    engine.step()
    engine.step()
    engine.add_request([7, 8], GREEDY, request_id="doomed")
    engine.add_request([3, 4, 5, 6], GREEDY, request_id="later")
    failed = []
    while engine.has_unfinished():
        failed += [e for e in engine.step() if e.error is not None]
    assert sorted(e.request_id for e in failed) == ["doomed", "later"]  # the batch that broke
    assert all(isinstance(e.error, BackendOutputError) for e in failed)
    assert engine.result("keep").token_ids == _alone(random_model, [1, 5, 9])
    assert engine.kv.blocks.num_tokens_in_use == 0


def test_correct_backends_pass_the_reference_check_in_every_phase(random_model):
    # prefill, chunked (continued) prefill and decode, each verified once, on the paged cache and int8
    for kv_cache, backend in (("contiguous", "sdpa"), ("contiguous", "naive"), ("paged", "paged"), ("int8", "paged")):
        config = EngineConfig(backend=backend, kv_cache=kv_cache, max_model_len=64, max_num_batched_tokens=4)
        engine = Engine(random_model, None, config)
        results = engine.generate([[1, 2, 3, 4, 5, 6, 7], [8, 9]], GREEDY)
        assert all(r.error is None and len(r.token_ids) == 8 for r in results), (backend, kv_cache)
        assert engine.runner.guards[id(engine.prefill_backend)]._verified == {"prefill", "continued prefill", "decode"}


def test_reference_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen) for s in ((3, 4, 8), (7, 2, 8), (7, 2, 8)))
    ref = reference_attention(q, k, v, context_len=4, layer=8**-0.5)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ref, want.transpose(0, 1))


def test_check_can_be_switched_off(random_model):
    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64, check_backend_outputs=False))
    assert engine.runner.guards == {}


def test_cli_exit_code_and_one_line(capsys, tmp_path):
    from pathlib import Path

    class PlantedNan(PlantedBackend):
        name = "planted-nan"

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    with registered(get_registry(), make_plugin(backends=[PlantedNan]), "planted_nan"):
        rc = main(["generate", "--model", str(tiny), "--backend", "planted-nan", "--max-new-tokens", "4", "hi"])
    err = capsys.readouterr().err
    assert rc == 4 == BackendOutputError.exit_code
    assert err.strip().splitlines()[-1].startswith(
        "kvcore: error: backend 'planted-nan' returned NaN or inf from forward (prefill")


@pytest.mark.parametrize("flag", ["kernel", "sums"])
def test_finite_check_is_not_fooled_by_a_sum_that_overflows(random_model, flag, monkeypatch):
    """The per-step flag (kvcore's all_finite operator where the kernels are loaded, else each tensor's sum): finite
    values whose sum overflows must pass, and one NaN or inf anywhere must still fail, naming its sequence."""
    from kvcore.execution import backend_check
    from kvcore.execution.backend_check import _StepCheck
    from kvcore.kernels.cpu_kernels import kernel_reasons, load_kernels

    if flag == "kernel":
        if kernel_reasons():
            pytest.skip("; ".join(kernel_reasons()))
        load_kernels()
    else:
        monkeypatch.setattr(backend_check, "kernels_loaded", lambda: False)

    engine = Engine(random_model, None, EngineConfig(backend="sdpa", max_model_len=64))
    guard = engine.runner.guards[id(engine.decode_backend)]
    big = torch.full((2, 4, 8), 3e38)  # finite, sum is inf
    check = _StepCheck(guard, None, None, verify=False, kind="decode")
    check.observe(0, big, big.clone())
    check.finish(torch.full((2, 50), 3e38))  # no error
    cases = (("out", r"returned NaN or inf from forward \(decode, layer 0\)"), ("logits", "NaN or inf logits"))
    two_decodes = SimpleNamespace(query_lens=[1, 1], cu_seqlens_q=torch.tensor([0, 1, 2]))
    for spoil, message in cases:
        out, logits = big.clone(), torch.zeros(2, 50)
        (out if spoil == "out" else logits)[1, 0].fill_(float("nan"))
        check = _StepCheck(guard, two_decodes, None, verify=False, kind="decode")
        check.observe(0, big, out)
        with pytest.raises(NonFiniteRowsError, match=message) as info:  # the second sequence only
            check.finish(logits)
        assert info.value.seq_indices == [1]

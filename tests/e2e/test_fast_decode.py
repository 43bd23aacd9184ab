"""Decode fast paths: the int4 LM head (model/lm_head.py) and compiled
decode steps (execution/compile.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import full_attention, make_random_model, weights_of

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams
from kvcore.errors import ConfigError
from kvcore.kernels.quant import Int4Groups, Int4Linear, int4_dense, pack_rows, unpack_codes
from kvcore.model.lm_head import INT4_MAX_ROWS, RescoredInt4Head


def test_int4_head_rescores_its_top_candidates_with_the_dense_head():
    """The int4 head's own top-k candidates get the dense head's logits (bfloat16 rounding of one dot product
    apart); every other logit is the int4 estimate; the best candidate is the dense best."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 64, generator=g) * 0.1).to(torch.bfloat16)
    head = RescoredInt4Head(w, top_k=16)
    for seed in range(5):
        hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        logits = head(hidden).float()
        approx = head.int4(hidden).float()
        exact = hidden.float() @ w.float().t()
        top = approx.topk(16, dim=-1).indices
        rescored = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
        bound = 2.0**-7 * exact.abs() + 1e-3  # one bfloat16 rounding of the dot product
        assert bool(((logits - exact).abs()[rescored] <= bound[rescored]).all())
        assert torch.equal(logits[~rescored], approx[~rescored])
        assert not torch.equal(approx[rescored], logits[rescored])  # the int4 estimates were replaced
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("vocab,k", [(1000, 64), (4096 + 37, 64), (200, 1), (96, 96)])
def test_rescore_top_k_replaces_exactly_each_rows_k_largest(vocab, k):
    """The kernel behind the int4 head: per row, the k largest estimates (the same set as torch.topk) become
    the float32 dot product rounded to bfloat16; nothing else changes. The head's weight is a strided view (row
    stride above d) and the vocabulary need not be a multiple of the kernel's 64-logit blocks."""
    from kvcore.kernels.cpu_kernels import load_kernels

    load_kernels()
    g = torch.Generator().manual_seed(vocab + k)
    d = 72
    weight = torch.randn(vocab, d + 8, generator=g).to(torch.bfloat16)[:, :d]
    hidden = torch.randn(3, d, generator=g).to(torch.bfloat16)
    # distinct positive estimates (distinct bit patterns: no ties), shuffled so the best are spread over the row
    bits = torch.stack([torch.randperm(8192, generator=g)[:vocab] + 0x3000 for _ in range(3)])
    est = bits.to(torch.int16).view(torch.bfloat16)
    est[1, 5] = float("nan")  # never selected
    got = torch.ops.kvcore.rescore_top_k(est.clone(), hidden, weight, k)
    ranked = est.float().nan_to_num(nan=float("-inf"))
    top = ranked.topk(k, dim=-1).indices
    picked = torch.zeros_like(est, dtype=torch.bool).scatter_(1, top, True)
    exact = (hidden.double() @ weight.double().t()).to(torch.bfloat16)
    assert torch.equal(got[~picked].view(torch.int16), est[~picked].view(torch.int16))
    diff = (got[picked].float() - exact[picked].float()).abs()
    assert bool((diff <= 2.0**-7 * exact[picked].float().abs() + 1e-6).all())  # one float32 sum apart at most


def test_rescore_top_k_rejects_bad_input():
    from kvcore.kernels.cpu_kernels import load_kernels

    load_kernels()
    w, h = torch.zeros(64, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k must be 1..V"):
        torch.ops.kvcore.rescore_top_k(torch.zeros(2, 64, dtype=torch.bfloat16), h, w, 65)
    with pytest.raises(RuntimeError, match="shapes must be"):
        torch.ops.kvcore.rescore_top_k(torch.zeros(2, 32, dtype=torch.bfloat16), h, w, 4)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvcore.rescore_top_k(torch.zeros(2, 64), h, w, 4)


def test_lm_head_option_errors(monkeypatch):
    with pytest.raises(ConfigError, match="lm_head 'int4' cannot run here: .*need dtype bfloat16"):
        EngineConfig(lm_head="int4", dtype="float16")
    EngineConfig(lm_head="int4", dtype="float32")  # float32 scores on the int8-activation kernel
    import kvcore.kernels.cpu_kernels

    # the rescoring is a kvcore kernel: without a compiler to build it, the int4 head is unavailable, and says why
    monkeypatch.setattr(kvcore.kernels.cpu_kernels, "kernel_reasons", lambda: ["no g++ or clang++ on PATH"])
    with pytest.raises(ConfigError, match="lm_head 'int4' cannot run here: no g\\+\\+ or clang\\+\\+ on PATH"):
        EngineConfig(lm_head="int4", dtype="bfloat16")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="unknown lm_head format 'int3'"):
        EngineConfig(lm_head="int3", dtype="bfloat16")
    odd_vocab = make_random_model(vocab_size=300).to(torch.bfloat16)  # 300 rows: not a multiple of 16
    with pytest.raises(ConfigError, match="vocabulary in multiples of 16"):
        Engine(odd_vocab, None, EngineConfig(dtype="bfloat16", backend="sdpa", lm_head="int4"))


def _streams(model, prompts, **config):
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_num_seqs=len(prompts), max_model_len=64, **config))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [r.token_ids for r in results], engine


def test_int4_head_greedy_streams_equal_the_dense_head():
    """Greedy streams through the int4 head equal the dense head's, at one row per step (int4 + rescoring)
    and at more rows than INT4_MAX_ROWS (the dense head)."""
    model = make_random_model(vocab_size=512, head_dim=16, num_heads=4).to(torch.bfloat16)
    for n in (1, INT4_MAX_ROWS + 2):
        prompts = [[3 + i, 40 + 7 * i, 99, 5 + i] for i in range(n)]
        dense, _ = _streams(model, prompts, dtype="bfloat16")
        int4, engine = _streams(model, prompts, dtype="bfloat16", lm_head="int4")
        assert engine.lm_head is not None
        assert int4 == dense


def test_compile_option_errors():
    model = make_random_model()
    with pytest.raises(ConfigError, match="backend 'naive' does not declare a torch.compile-traceable decode"):
        Engine(model, None, EngineConfig(backend="naive", compile=True))
    with pytest.raises(ConfigError, match="compile must be true or false"):
        EngineConfig(compile="yes")


def test_compiled_decode_equals_eager_in_float32():
    """Decode steps through torch.compile give the eager float32 streams token for token: one sequence, then
    a ragged batch (key-padding mask, another batch size: the recompile with dynamic sizes). The compiled
    function ran for the decode steps, and the backend guard still saw layer 0's output."""
    model = make_random_model(num_layers=2)
    prompts = [[5, 9, 200, 31, 7], [8, 8, 120], [250, 3, 14, 15, 92, 65, 35]]
    for batch in (prompts[:1], prompts):
        eager, _ = _streams(model, batch)
        engine = Engine(model, None, EngineConfig(backend="sdpa", max_num_seqs=3, max_model_len=64, compile=True))
        calls = []

        def counted(*args, fn=engine.compiled_decode._fn, calls=calls):
            calls.append(args[5].shape[0])  # input_ids [B] (after model, backend, cache, plans, layer_groups)
            return fn(*args)

        engine.compiled_decode._fn = counted
        guard = engine.runner.guards[id(engine.decode_backend)]
        results = engine.generate(batch, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [r.token_ids for r in results] == eager
        assert len(calls) >= 11 and max(calls) == len(batch)  # every decode step after the first token
        assert "decode" in guard._verified



def test_a_compiled_engine_reads_its_own_weights():
    """The compiled code is shared by engines whose models have the same shapes (the guards on weights are
    dropped): each must still run with its own weights and format, never the first engine's."""
    prompts = [[5, 9, 200, 31, 7]]
    for seed in (3, 4):
        model = make_random_model(num_layers=2, seed=seed)
        eager, _ = _streams(model, prompts)
        compiled, _ = _streams(model, prompts, compile=True)
        assert compiled == eager, seed
    assert _streams(make_random_model(num_layers=2, seed=3), prompts)[0] != eager  # the two models differ


def test_int4_codes_unpack_and_dequantize_like_the_kernel():
    """unpack_codes inverts the kernel's packing (this torch build), and int4_dense gives the kernel's own
    dequantized weights (read back through the kernel), rounded once to bfloat16; the block size follows the
    CPU torch runs on (its AVX-512 and AVX2 kernels pack differently)."""
    rows = pack_rows()
    assert rows == (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32)
    g = torch.Generator().manual_seed(1)
    for n, k in ((128, 64), (192, 256)):
        groups = Int4Groups.from_float(torch.randn(n, k, generator=g), 32)
        lin = Int4Linear(groups)
        assert lin.unpackable and torch.equal(unpack_codes(lin.packed, n, k, rows), groups.q)
        dense = int4_dense(lin.packed, lin.scales_and_zeros, lin.group_size, rows)
        assert dense.dtype == torch.bfloat16
        assert torch.equal(dense, lin.dequantize().to(torch.bfloat16))
    assert not Int4Linear(Int4Groups.from_float(torch.randn(48, 64, generator=g), 32)).unpackable  # 48 rows


def test_long_int4_prefills_run_on_dequantized_weights(monkeypatch):
    """With compile on, a prefill of DENSE_PREFILL_ROWS rows or more runs the int4 layer matmuls as bfloat16
    GEMMs on compiled-dequantized weights: the hidden states equal the int4 kernel's within bfloat16 rounding;
    shorter prefills and float models keep their own matmuls."""
    import kvcore.execution.compile as kc

    monkeypatch.setattr(kc, "DENSE_PREFILL_ROWS", 16)
    base = make_random_model(num_layers=2, vocab_size=512)
    model = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4")
    compiled = Engine(model, None, EngineConfig(backend="sdpa", dtype="bfloat16", compile=True)).compiled_decode
    assert compiled.prefill_matmuls(model, 15) is None and compiled.prefill_matmuls(base, 64) is None
    mm = compiled.prefill_matmuls(model, 64)
    assert mm is not None and all(isinstance(f, kc._DequantizedInt4) for f in mm["gate_up"])
    ids = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        dense = model(ids, torch.arange(64), full_attention, mm).float()
        int4 = model(ids, torch.arange(64), full_attention).float()
    assert float((dense - int4).abs().max()) <= 0.05 * float(int4.abs().max())


def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch):
    """A compile that fails (here: Inductor raising) must not fail request after request: one RuntimeWarning,
    then the engine runs eagerly, with the eager streams; int4 prefills fall back to the int4 kernel."""
    import kvcore.execution.compile as kc

    model = make_random_model(num_layers=2)
    prompts = [[5, 9, 200, 31, 7], [8, 8, 120]]
    eager, _ = _streams(model, prompts)
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_num_seqs=2, max_model_len=64, compile=True))

    def broken(*args):
        raise RuntimeError("C++ compile failed: Python.h: No such file or directory")

    engine.compiled_decode._fn = broken
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*Python.h.*runs eagerly") as caught:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [r.token_ids for r in results] == eager and all(r.error is None for r in results)
    assert len([w for w in caught if "torch.compile failed" in str(w.message)]) == 1
    assert engine.compiled_decode.failed.startswith("RuntimeError")

    monkeypatch.setattr(kc, "DENSE_PREFILL_ROWS", 4)
    base = make_random_model(num_layers=2, vocab_size=512)
    int4 = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4")
    compiled = Engine(int4, None, EngineConfig(backend="sdpa", dtype="bfloat16", compile=True)).compiled_decode
    mm = compiled.prefill_matmuls(int4, 8)
    compiled.dequantize = broken
    x = torch.randn(8, mm["o"][0].linear.shape[1]).to(torch.bfloat16)  # o_proj's input width
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        assert torch.equal(mm["o"][0](x), int4.matmuls(8)["o"][0](x))  # the int4 kernel's own result
    assert compiled.prefill_matmuls(int4, 8) is None  # from now on the model's own int4 matmuls

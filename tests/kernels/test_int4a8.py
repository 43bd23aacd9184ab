"""The ``int4a8`` weight format: int4 weights, matmuls with int8 activations (kvcore/kernels/csrc/int4_linear.cpp)."""

from __future__ import annotations

import pytest
import torch
from helpers import full_attention, make_random_model, weights_of

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams
from kvcore.errors import ConfigError
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.kernels.quant import Int4A8Linear, Int4Groups
from kvcore.model.lm_head import A8_MAX_ROWS

needs_kernel = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))


def _emulated(groups: Int4Groups, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per row and group of 32 in float32 (a = max|x| / 127,
    p = round(x * (127 / max|x|))), W = d q + m with d and m rounded to float16; sum_g d a (q . p) + m a sum(p)."""
    n, k = groups.shape
    xf = x.float().view(x.shape[0], k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # codes rounded from float32 x * (127 / amax), a true division (torch's 127 / t is 127 * t.reciprocal())
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    p, a = (xf * inv).round().double(), (amax / 127).double()
    d = groups.scales.half().double()  # [N, G]
    m = (groups.zeros - 8 * groups.scales).half().double()
    q = groups.q.double().view(n, k // 32, 32)
    dots = torch.einsum("rgk,ngk->rng", p, q)  # [M, N, G]
    sums = (a * p.sum(-1, keepdim=True)).squeeze(-1)  # [M, G]: the quantized activations' sums
    return (dots * d[None] * a.squeeze(-1)[:, None] + m[None] * sums[:, None]).sum(-1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 45])  # one tile of all rows (decode); tiles of rows (prefill)
@pytest.mark.parametrize("kind", ["q4_1", "q4_0"])
def test_kernel_equals_its_arithmetic(rows, kind):
    """Every code, scale and offset lands where the kernel reads it (a layout slip is an O(1) error); what is
    left is the output's bfloat16 rounding and the float32 sums."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 96, generator=g) * 0.05
    groups = Int4Groups.from_float(w)
    if kind == "q4_0":  # symmetric blocks: m = -8 d
        groups = Int4Groups(groups.q, groups.scales, torch.zeros_like(groups.zeros))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero activation group (scale 0)
    got = Int4A8Linear(groups)(x).double()
    want = _emulated(groups, x)
    assert got.shape == (rows, 48)
    assert bool(((got - want).abs() <= 2.0**-7 * want.abs() + 1e-3).all())


@needs_kernel
def test_activation_rounding_costs_what_llama_cpp_q8_costs():
    """The offset term uses the quantized activations' sum (llama.cpp's Q8_1 ``s``): the codes are unsigned (mean
    near 7.5), so their products carry each activation's rounding error times that mean, and only ``m a sum(p)``
    takes it back out. The error is then that of quantizing x alone, next to the output's bfloat16 rounding; with
    the exact ``m sum(x)`` it was about 1.6 times that."""
    g = torch.Generator().manual_seed(0)
    groups = Int4Groups.from_float(torch.randn(64, 512, generator=g) * 0.05)
    w = groups.dequantize().double()
    x = torch.randn(16, 512, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.t()
    xg = x.double().view(16, -1, 32)
    a = xg.abs().amax(-1, keepdim=True) / 127
    quantized_x = ((xg / a).round() * a).view(16, 512) @ w.t()  # only the activations rounded

    def error(y):
        return float((y - exact).norm() / exact.norm())

    floor = (error(quantized_x) ** 2 + error(exact.to(torch.bfloat16).double()) ** 2) ** 0.5
    assert error(Int4A8Linear(groups)(x).double()) <= 1.05 * floor


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_the_largest_codes_and_activations_do_not_overflow(rows):
    """Codes 15 against activation codes +-127 everywhere: the largest integer sums the products reach (the AVX2
    path adds them in int16 before widening; a sum that wrapped or saturated is off by the output's size)."""
    n, k = 32, 256
    groups = Int4Groups(torch.full((n, k), 15, dtype=torch.uint8), torch.full((n, k // 32), 0.01),
                        torch.full((n, k // 32), 0.08))  # m = 0: W = 0.01 * 15
    x = torch.ones(rows, k, dtype=torch.bfloat16)
    x[::2] = -1
    got, want = Int4A8Linear(groups)(x).double(), _emulated(groups, x)
    assert bool(((got - want).abs() <= 2.0**-7 * want.abs()).all())
    assert abs(float(got[0, 0]) + 0.15 * k) <= 2.0**-7 * 0.15 * k


@needs_kernel
def test_a_row_gives_the_same_result_alone_and_in_any_batch():
    """Rows are quantized and summed on their own, in the same order whichever path runs them (few rows: one tile
    split over output blocks; more: tiles of rows): a prompt's prefill and its decode steps compute the same."""
    g = torch.Generator().manual_seed(0)
    lin = Int4A8Linear(Int4Groups.from_float(torch.randn(64, 128, generator=g)))
    x = torch.randn(50, 128, generator=g).to(torch.bfloat16)
    together = lin(x)
    assert all(torch.equal(together[i : i + 1], lin(x[i : i + 1])) for i in range(50))
    assert torch.equal(together[:16], lin(x[:16]))


@needs_kernel
def test_a_model_runs_close_to_int4():
    """The tiny random model in int4a8 against the same int4 weights with bfloat16 activations: a forward of 8 rows
    (the int4a8 kernel) stays within a fifth of the logits' scale (the activations' int8 rounding, compounded over
    the layers of an untrained model; a layout or scale slip gives errors of the logits' own size) and picks the
    same top token at most positions; a greedy stream runs through the engine (prefill and decode on the kernel)."""
    base = make_random_model(num_layers=2)
    models = {fmt: LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format=fmt)
              for fmt in ("int4", "int4a8")}
    ids, pos = torch.tensor([5, 9, 200, 31, 7, 8, 120, 3]), torch.arange(8)
    logits = {fmt: m.compute_logits(m(ids, pos, full_attention)).float() for fmt, m in models.items()}
    scale = float(logits["int4"].abs().max())
    assert 0 < float((logits["int4a8"] - logits["int4"]).abs().max()) <= 0.2 * scale
    assert int((logits["int4a8"].argmax(-1) == logits["int4"].argmax(-1)).sum()) >= 6
    engine = Engine(models["int4a8"], None, EngineConfig(backend="sdpa", dtype="bfloat16", max_model_len=64))
    result = engine.generate([[5, 9, 200, 31, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert result.error is None and len(result.token_ids) == 8


def test_option_errors():
    with pytest.raises(ConfigError, match="weights 'int4a8' cannot run here: .*need dtype float32 or bfloat16"):
        EngineConfig(weights="int4a8", dtype="float16")


@needs_kernel
def test_the_int4_head_scores_with_the_a8_kernel_for_int4a8_models():
    """With int4a8 weights the rescored int4 head takes up to 16 rows through the int8-activation kernel; its top
    candidates still carry the dense head's logits, so the best token is the dense best."""
    from kvcore.model.lm_head import RescoredInt4Head

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 64, generator=g) * 0.1).to(torch.bfloat16)
    head = RescoredInt4Head(w, top_k=16, a8=True)
    assert isinstance(head.int4, Int4A8Linear) and head.max_rows == A8_MAX_ROWS
    hidden = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    logits, exact = head(hidden).float(), hidden.float() @ w.float().t()
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    best = exact.argmax(-1, keepdim=True)
    assert bool(((logits.gather(1, best) - exact.gather(1, best)).abs() <= 2.0**-7 * exact.gather(1, best).abs()
                 + 1e-3).all())


@needs_kernel
def test_the_kernel_was_built_with_a_vector_path():
    """Where int4a8 is offered, the library must hold the AVX512-VNNI code or the AVX2 code this CPU was chosen
    for, not the portable loops (correct but many times slower)."""
    from kvcore.kernels.cpu_kernels import int8_dot_isa, load_kernels

    load_kernels()  # (run alone, nothing before this test has loaded the library)
    assert torch.ops.kvcore.built_with(int8_dot_isa())
    assert torch.ops.kvcore.built_with("avx512_vnni") != torch.ops.kvcore.built_with("avx2_dot")


@needs_kernel
@pytest.mark.parametrize("lm_head", ["auto", "int4"])
def test_the_dense_head_is_not_packed_while_the_int4_head_serves_every_step(monkeypatch, lm_head):
    """A quantized model whose packed head (int8 by default, or int4) scores its decode steps holds the dense head
    once (the tied embedding table): no packed copy of it is built for forwards that never read it; a batch above the
    packed head's rows still gets the dense head."""
    import kvcore.kernels.linear

    monkeypatch.setattr(kvcore.kernels.linear, "COLUMN_MAJOR_MIN_NUMEL", 1)  # the tiny head counts as big: packable
    base = make_random_model(num_layers=2, vocab_size=512, tie=True)
    model = LlamaModel.from_weights(base.config, weights_of(base), torch.bfloat16, weight_format="int4a8")
    engine = Engine(model, None, EngineConfig(backend="sdpa", max_model_len=64, lm_head=lm_head))
    assert engine.config.lm_head == ("int8" if lm_head == "auto" else lm_head)  # auto: quantized weights
    result = engine.generate([[5, 9, 200, 31, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert result.error is None and len(result.token_ids) == 6
    assert model._dense._cache == {}  # neither a kernel-packed nor a oneDNN copy of the head
    hidden = torch.randn(A8_MAX_ROWS + 1, model.config.hidden_size).to(torch.bfloat16)
    assert model.compute_logits(hidden, engine.lm_head).shape == (A8_MAX_ROWS + 1, 512)
    assert model._dense._cache  # the dense head, built when a batch needs it

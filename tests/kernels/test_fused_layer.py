"""The fused decoder layers (csrc/fused_layer.cpp, model/fused_layer.py) against the eager int4a8 layers: the
same attention inputs and hidden states bit for bit, the same greedy streams, compiled or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import full_attention, make_random_model

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams
from kvcore.kernels.cpu_kernels import int4a8_reasons
from kvcore.model.fused_layer import fused_layer_reasons

pytestmark = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))


def _random_weights(config, seed: int) -> dict[str, torch.Tensor]:
    """Canonical weights of ``config`` (a Llama shape): matrices of std 0.3 / sqrt(in), norms near 1."""
    from kvcore.loaders import expected_shapes

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 2:
            weights[name] = torch.randn(shape, generator=gen) * (0.3 if "embed" in name else shape[1] ** -0.5)
        else:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return weights


def _model(head_dim: int, intermediate: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
           **options) -> LlamaModel:
    """A random 2-layer int4a8 model in ``dtype``: 4 query heads, 2 KV heads of ``head_dim``; ``options`` change the
    config."""
    config = dataclasses.replace(make_random_model(num_layers=2, head_dim=head_dim).config,
                                 intermediate_size=intermediate, **options)
    return LlamaModel.from_weights(config, _random_weights(config, seed), dtype, weight_format="int4a8")


#: (head_dim, intermediate): RoPE on ATen's vectors (a half of 32) or its scalar loop (8); the gate's silu all in
#: vector pairs (a multiple of 64) or with the scalar remainder ATen's kernel leaves (96 = 64 + 32)
SHAPES = [(64, 512), (16, 96)]


def _run(model: LlamaModel, fused: bool, ids: torch.Tensor, positions: torch.Tensor):
    """``(hidden [T, d], [per layer: (q, k, v)] the attention call saw)`` with the fused layers on or off."""
    seen = []

    def attention(layer, q, k, v):
        seen.append((q.clone(), k.clone(), v.clone()))
        return full_attention(layer, q, k, v)

    model.fused_layers = fused
    try:
        return model(ids, positions, attention), seen
    finally:
        model.fused_layers = True


def _same(model: LlamaModel, ids: torch.Tensor, positions: torch.Tensor) -> bool:
    (fused, fused_seen), (eager, eager_seen) = (_run(model, f, ids, positions) for f in (True, False))
    assert fused.shape == eager.shape and len(fused_seen) == len(eager_seen) == model.config.num_hidden_layers
    return torch.equal(fused, eager) and all(
        all(torch.equal(a, b) for a, b in zip(f, e)) for f, e in zip(fused_seen, eager_seen))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 17])  # decode rows, speculative verify rows, a prefill (parallel rows)
@pytest.mark.parametrize("start", [0, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_layers_compute_the_eager_layers_bit_for_bit(shape, rows, start, dtype):
    """In float32 too: a product fused into a multiply-add (RoPE's) differs in its last bit, and int8 activation
    codes then round differently."""
    model = _model(*shape, seed=rows, dtype=dtype)
    assert model.fused_layers and not fused_layer_reasons(model)
    gen = torch.Generator().manual_seed(start + rows)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)
    assert _same(model, ids, torch.arange(start, start + rows))


def test_the_fused_operators_run_twice_per_layer(monkeypatch):
    model = _model(64, 512)
    calls = []
    for op in ("fused_qkv", "fused_mlp"):
        kernel = getattr(torch.ops.kvcore, op)
        monkeypatch.setattr(torch.ops.kvcore, op, lambda *args, op=op, kernel=kernel: calls.append(op) or kernel(*args))
    model(torch.tensor([5, 9, 7]), torch.arange(3), full_attention)
    assert calls == ["fused_qkv", "fused_mlp"] * model.config.num_hidden_layers


@pytest.mark.parametrize("bug", ["rope rotated the other way", "attention output not added to the residual"])
def test_a_planted_bug_is_caught(monkeypatch, bug):
    """The comparison sees a slip the operators' inputs could carry: RoPE's sign-folded sine half flipped, or the
    residual stream not updated by the attention output."""
    model = _model(64, 512)
    qkv, mlp = torch.ops.kvcore.fused_qkv, torch.ops.kvcore.fused_mlp
    if bug.startswith("rope"):
        monkeypatch.setattr(torch.ops.kvcore, "fused_qkv", lambda h, d, w, eps, p, dm, cos, sin, n:
                            qkv(h, d, w, eps, p, dm, cos, -sin, n))
    else:
        monkeypatch.setattr(torch.ops.kvcore, "fused_mlp", lambda h, *args: mlp(h.clone(), *args))
    assert not _same(model, torch.tensor([5, 9, 7]), torch.arange(40, 43))


def test_only_layers_the_operators_spell_out_are_fused():
    base = make_random_model(num_layers=1, head_dim=32)
    weights = _random_weights(base.config, 0)
    assert not LlamaModel.from_weights(base.config, weights, torch.bfloat16, weight_format="int4").fused_layers
    assert not LlamaModel.from_weights(base.config, weights, torch.bfloat16).fused_layers  # dense
    qwen2 = dataclasses.replace(base.config, attention_bias=True)
    model = LlamaModel.from_weights(qwen2, _random_weights(qwen2, 0), torch.bfloat16, weight_format="int4a8")
    assert not model.fused_layers and fused_layer_reasons(model) == ["the fused layers have no Q/K/V biases"]
    gelu = dataclasses.replace(base.config, hidden_act="gelu_pytorch_tanh")
    model = LlamaModel.from_weights(gelu, weights, torch.bfloat16, weight_format="int4a8")
    assert fused_layer_reasons(model) == ["the fused layers gate with SiLU, not gelu_pytorch_tanh"]


def _streams(model: LlamaModel, fused: bool, compile: bool = False) -> list[list[int]]:
    model.fused_layers = fused
    engine = Engine(model, None, EngineConfig(backend="cpu_decode", dtype="bfloat16", max_num_seqs=3,
                                              max_model_len=64, compile=compile))
    prompts = [[5, 9, 200, 31, 7], [8, 8, 120], [250, 3, 14, 15, 92, 65, 35]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    if compile:
        assert engine.compiled_decode.failed is None
    model.fused_layers = True
    return [r.token_ids for r in results]


def test_compiled_decode_steps_trace_the_fused_operators():
    """torch.compile traces the operators (their fake implementations give the shapes) and decodes the eager
    streams, three sequences at a time."""
    model = _model(64, 512)
    assert _streams(model, True, compile=True) == _streams(model, False)


@pytest.mark.slow
def test_the_embedded_model_decodes_the_same_tokens_fused():
    """The default engine on the embedded SmolLM2 (Q4_1 blocks on the int4a8 kernel): greedy streams of three
    prompts decoded together equal those of the eager layers, and so do the logits of a prefill."""
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=256, max_num_seqs=3))
    model = engine.model
    assert model.fused_layers
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    params = SamplingParams(max_new_tokens=24)
    streams = {}
    for fused in (True, False):
        model.fused_layers = fused
        streams[fused] = [r.token_ids for r in engine.generate(prompts, params)]
    model.fused_layers = True
    assert streams[True] == streams[False]
    ids = torch.tensor(engine.tokenizer.encode(prompts[2]))
    assert _same(model, ids, torch.arange(len(ids)))

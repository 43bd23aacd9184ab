"""Quantized weights (kernels.quant, model.weights, loaders.gguf_blocks): the GGUF mapping is exact, the
kernels compute what the dequantized weights do, models built on them decode like the float model (up to
near-ties), and the option's errors are clear."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import full_attention, make_random_model, weights_of

from kvcore.engine.core import Engine, EngineConfig
from kvcore.errors import ConfigError
from kvcore.kernels.int8 import Int8Linear
from kvcore.kernels.quant import Int4Groups, Int4Linear
from kvcore.loaders.gguf import unpermute_qk
from kvcore.loaders.gguf_blocks import GGUFBlocks
from kvcore.model.decoder import LlamaModel
from kvcore.model.weights import LINEAR_PARTS, resolve_weights


def random_blocks(qtype: QType, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Random Q4_0 / Q4_1 blocks: float16 scales (and minima), random nibbles."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    d = (rng.random(n, dtype=np.float32) * 0.02 + 1e-3).astype(np.float16)
    parts = [d.view(np.uint8).reshape(n, 2)]
    if qtype == QType.Q4_1:
        m = (-rng.random(n, dtype=np.float32) * 0.15).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(n, 2))
    parts.append(rng.integers(0, 256, (n, 16), dtype=np.uint8))
    return GGUFBlocks(qtype, np.concatenate(parts, axis=1).reshape(rows, -1), (rows, cols))


def bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise error bound of ``x @ w.T`` with bfloat16 output, scales and offsets (8-bit mantissas):
    a few units of 2^-8 relative to the sum of absolute terms."""
    return 4 * 2.0**-8 * (x.float().abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_q4_blocks_are_exactly_int4_groups(qtype):
    blocks = random_blocks(qtype, 48, 128)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.data, qtype)).reshape(48, 128)
    groups = blocks.int4_groups()
    assert groups.group_size == 32 and int(groups.q.max()) <= 15
    assert torch.equal(groups.dequantize(), reference)  # bit for bit, as llama.cpp's reference
    assert torch.equal(blocks.dequantize(), reference)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
@pytest.mark.parametrize("field", [0, 1])  # the scale d, or (Q4_1) the minimum m
def test_blocks_kept_packed_are_checked_for_nan_and_inf(qtype, field):
    blocks = random_blocks(qtype, 16, 64)
    assert blocks.is_finite()
    if field == 1 and qtype == QType.Q4_0:
        blocks.data.reshape(-1, 18)[5, 2:4] = 0xFF  # Q4_0 has no minimum: bytes 2-3 are codes, any value is fine
        assert blocks.is_finite()
        return
    per_block = 18 if qtype == QType.Q4_0 else 20
    blocks.data.reshape(-1, per_block)[5, 2 * field: 2 * field + 2] = np.array([np.inf], np.float16).view(np.uint8)
    assert not blocks.is_finite()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_int4_kernel_convention(qtype):
    """With float32 activations and scales the kernel's ``(q - 8) * s + z`` is the GGUF value up to float32
    summation order: the mapping and the packing are right (a wrong offset or nibble order is far off)."""
    groups = random_blocks(qtype, 64, 256, seed=1).int4_groups()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 2)
    scales_and_zeros = torch.stack([groups.scales.t(), groups.zeros.t()], -1).contiguous()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    ref = x @ groups.dequantize().t()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_int4_linear_matches_dequantized_matmul_within_bf16(qtype):
    blocks = random_blocks(qtype, 96, 256, seed=2)
    w = blocks.dequantize()
    lin = Int4Linear(blocks.int4_groups())
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    err = (lin(x).float() - x.float() @ w.t()).abs()
    assert lin(x).dtype == torch.bfloat16 and bool((err <= bf16_bound(x, w)).all())
    # the kernel's own weight is the GGUF one up to the bfloat16 rounding of scales and offsets
    assert (lin.dequantize() - w).abs().max() <= 2.0**-8 * w.abs().max() * 4
    assert lin.nbytes < w.numel() // 2 + w.numel() // 8 + 1  # 4 bits + 2 bf16 per 32 weights


def test_unpermute_commutes_with_the_blocks():
    blocks = random_blocks(QType.Q4_1, 64, 64, seed=4)
    moved = blocks.map_rows(lambda rows: unpermute_qk(rows, 4))
    assert torch.equal(moved.dequantize(), torch.from_numpy(unpermute_qk(blocks.dequantize().numpy(), 4)))
    a, b = blocks.split([16, 48])
    assert torch.equal(torch.cat([a.dequantize(), b.dequantize()]), blocks.dequantize())


def test_quantize_float_weights():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(5))
    for group in (32, 128):
        g = Int4Groups.from_float(w, group)
        step, z = (t.repeat_interleave(group, 1) for t in (g.scales, g.zeros))
        assert bool(((g.dequantize() - w).abs() <= step / 2 + z.abs() * 2.0**-8 + 1e-6).all())
        assert torch.equal(g.scales, g.scales.bfloat16().float())  # what the kernel reads: no second rounding
    i8 = Int8Linear(w)
    assert bool(((i8.dequantize() - w).abs() <= i8.scales.float()[:, None] * 0.5 + 1e-6).all())
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert bool(((i8(x).float() - x.float() @ i8.dequantize().t()).abs() <= bf16_bound(x, w)).all())
    assert not Int4Linear.fits(24, 256, 32) and not Int4Linear.fits(32, 48, 32) and not Int8Linear.fits(8, 40)


def first_divergence(ref: LlamaModel, got: LlamaModel, prompt: list[int], steps: int):
    """Greedy-decode both models with full recomputation (no cache: the reference is plain); returns None when
    the streams agree for ``steps`` tokens, else (step, the reference's top-2 logit gap there)."""
    ids = list(prompt)
    for step in range(steps):
        logits = [m.compute_logits(m(torch.tensor(ids), torch.arange(len(ids)), full_attention)[-1:])[0]
                  for m in (ref, got)]
        a, b = int(logits[0].argmax()), int(logits[1].argmax())
        if a != b:
            return step, float(logits[0][a] - logits[0][b])
        ids.append(a)
    return None


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_random_model_decodes_like_float(fmt):
    """The tiny random model with its weights quantized at load (from float) against the same quantized values
    run densely: the logits differ by no more than bfloat16 activations alone make them differ (``noise``:
    the dense bfloat16 model against float32), and greedy streams agree or part at a near-tie (a float32
    top-2 gap within that noise)."""
    model = make_random_model(num_layers=2, vocab_size=300)
    weights = weights_of(model)
    quant = LlamaModel.from_weights(model.config, weights, torch.bfloat16, weight_format=fmt)
    assert quant.weight_format == fmt and quant.qkv_proj[0].numel() == 0  # no dense copy kept
    deq = dict(weights)  # the weights the kernels multiply by, as dense tensors
    for i in range(model.config.num_hidden_layers):
        for name, parts in LINEAR_PARTS.items():
            names = [f"model.layers.{i}.{part}" for part in parts]
            full = quant._quantized[name][i].dequantize()
            deq.update(zip(names, full.split([weights[n].shape[0] for n in names])))
    deq = {n: w.to(torch.bfloat16).float() for n, w in deq.items()}  # the head and embeddings as quant has them
    ref = LlamaModel.from_weights(model.config, deq, torch.float32)
    dense_bf16 = LlamaModel.from_weights(model.config, deq, torch.bfloat16)
    for seed in range(3):
        prompt = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
        logits = {m: m.compute_logits(m(ids, pos, full_attention)) for m in (ref, dense_bf16, quant)}
        noise = float((logits[dense_bf16] - logits[ref]).abs().max())
        assert float((logits[quant] - logits[ref]).abs().max()) <= 3 * noise
        diverged = first_divergence(ref, quant, prompt, steps=12)
        assert diverged is None or diverged[1] <= 2 * noise, (diverged, noise)


def test_weights_option_errors_and_plumbing(tmp_path):
    with pytest.raises(ConfigError, match="need dtype bfloat16"):
        EngineConfig(weights="int4", dtype="float32")
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(weights="int8", dtype="bfloat16", device="meta")
    with pytest.raises(ConfigError, match="unknown weights format 'int3'"):
        EngineConfig(weights="int3", dtype="bfloat16")
    assert EngineConfig(weights="int4", dtype="bfloat16").weights == "int4"
    model = make_random_model()
    with pytest.raises(ConfigError, match="model weights are float but the engine was configured for int8"):
        Engine(model.to(torch.bfloat16), None, EngineConfig(weights="int8", dtype="bfloat16", backend="sdpa"))
    quant = LlamaModel.from_weights(model.config, weights_of(make_random_model()), torch.bfloat16,
                                    weight_format="int4")
    with pytest.raises(ConfigError, match="tensor parallelism shards dense weights"):
        Engine(quant, None, EngineConfig(dtype="bfloat16", backend="sdpa", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="cannot move this model to cpu float32: int4 weights need dtype bfloat16"):
        quant.float()
    assert quant.dtype == torch.bfloat16 and quant.embed_tokens.dtype == torch.bfloat16  # nothing was moved
    from kvcore.engine.file_config import load_config

    (tmp_path / "kvcore.toml").write_text('weights = "int8"\n')
    assert load_config(tmp_path / "kvcore.toml").weights == "int8"


def test_auto_picks_int4_only_for_exact_gguf_blocks_in_bf16():
    model = make_random_model()
    c, weights = model.config, weights_of(model)
    assert resolve_weights("auto", torch.bfloat16, "cpu", c, weights) == "float"  # float checkpoint: no silent loss
    blocks = {n: (random_blocks(QType.Q4_1, *w.shape) if ".layers." in n and w.dim() == 2 else w)
              for n, w in weights.items()}
    assert resolve_weights("auto", torch.bfloat16, "cpu", c, blocks) == "int4"
    assert resolve_weights("auto", torch.float32, "cpu", c, blocks) == "float"  # float32 stays the exact reference
    with pytest.raises(ConfigError, match="weights 'int4' cannot run here"):
        resolve_weights("int4", torch.float32, "cpu", c, blocks)
    quant = LlamaModel.from_weights(c, blocks, torch.bfloat16, weight_format="int4")
    x = torch.randn(2, c.hidden_size).to(torch.bfloat16)
    w = torch.cat([blocks[f"model.layers.0.mlp.{n}_proj.weight"].dequantize() for n in ("gate", "up")])
    assert bool(((quant._quantized["gate_up"][0](x).float() - x.float() @ w.t()).abs() <= bf16_bound(x, w)).all())


def test_bf16_dense_matmuls_match_plain_linear():
    """bfloat16 models run prepacked copies (kvcore's bf16_linear kernel where the CPU has AVX512_BF16, else
    oneDNN's where it has bfloat16 dot products): the same
    outputs as plain ``F.linear`` within bfloat16 rounding, at one row and at many."""
    model = make_random_model(num_heads=8, head_dim=64, num_layers=1, vocab_size=512).to(torch.bfloat16)
    plain = make_random_model(num_heads=8, head_dim=64, num_layers=1, vocab_size=512).to(torch.bfloat16)
    plain.packed_weights = False
    for rows in (1, 5):
        ids, pos = torch.arange(rows) + 3, torch.arange(rows)
        a = model.compute_logits(model(ids, pos, full_attention))
        b = plain.compute_logits(plain(ids, pos, full_attention))
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_cpu_features_describe():
    from kvcore.kernels.cpu import cpu_features

    f = cpu_features()
    assert f.threads == torch.get_num_threads() and f.torch_capability
    assert str(f.threads) in f.describe() and f.as_dict()["bf16_matmul"] == f.bf16_matmul


def test_smollm2_int4_native_decodes_like_the_dequantized_float_model(smollm2):
    """The embedded Q4_1 SmolLM2 with ``weights="auto"`` in bfloat16 runs its file's Q4_1 blocks on the int4
    kernel: greedy tokens on a golden prompt equal the float32 (dequantized) model's, or part at a near-tie
    (a float32 top-2 gap within what bfloat16 activations alone move the logits)."""
    import json
    from pathlib import Path

    from kvcore.loaders import build_model, load_model

    prompt = json.loads((Path(__file__).parents[1] / "data" / "golden_smollm2.json").read_text())["prompts"][0]
    blocks = load_model("smollm2", keep_quantized=True)
    quant = build_model(blocks, torch.bfloat16, max_model_len=128, weights="auto")
    assert quant.weight_format == "int4" and quant.embed_tokens.dtype == torch.bfloat16
    ref = build_model(smollm2, torch.float32, max_model_len=128)
    dense_bf16 = build_model(smollm2, torch.bfloat16, max_model_len=128, weights="float")
    ids = torch.tensor(prompt["prompt_token_ids"])
    pos = torch.arange(len(ids))
    logits = {m: m.compute_logits(m(ids, pos, full_attention)) for m in (ref, dense_bf16, quant)}
    noise = float((logits[dense_bf16] - logits[ref]).abs().max())
    assert float((logits[quant] - logits[ref]).abs().max()) <= 2 * noise
    diverged = first_divergence(ref, quant, prompt["prompt_token_ids"], steps=16)
    assert diverged is None or diverged[1] <= 2 * noise, (diverged, noise)


def test_cli_weights_flag(capsys):
    """``--weights`` reaches the engine (a float checkpoint quantized at load), and a format the dtype cannot
    run is one line with the config exit code."""
    import json
    from pathlib import Path

    from kvcore.cli import main

    tiny = str(Path(__file__).parents[1] / "data" / "tiny-llama")
    argv = ["generate", "--model", tiny, "--backend", "sdpa", "--max-new-tokens", "4", "--ignore-eos", "--json"]
    for fmt in ("int4", "int8"):
        assert main([*argv, "--dtype", "bfloat16", "--weights", fmt, "hello"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["weights"] == fmt and len(result["token_ids"]) == 4
    assert main([*argv, "--dtype", "float32", "--weights", "int4", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "weights 'int4' cannot run here" in err and "--dtype bfloat16" in err

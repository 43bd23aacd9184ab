"""kvcore's own CPU decode-attention kernel (kernels/csrc/decode_attention.cpp) and the ``cpu_decode`` backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from golden import GOLDEN_TOKENS, check_against_golden, load_golden
from helpers import make_random_model

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.conformance.results import PASS
from kvcore.conformance.runner import run_suite
from kvcore.conformance.settings import SuiteConfig
from kvcore.errors import BackendUnavailableError
from kvcore.interfaces.attention import causal_mask
from kvcore.plugins.registry import PluginRegistry

pytestmark = pytest.mark.skipif(CPUDecodeBackend.availability() is not None, reason="no C++ toolchain here")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    import kvcore.kernels.cpu_kernels

    return kvcore.kernels.cpu_kernels.load_kernels()


def _reference(q, k, v, lens, scale):
    """float64 softmax(q k^T * scale) v per sequence over its first ``lens[b]`` keys: ``[B, H_kv, G, D]``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        scores = torch.einsum("hgd,hld->hgl", q[b].double(), k[b, :, :n].double()) * scale
        out[b] = torch.einsum("hgl,hld->hgd", scores.softmax(-1), v[b, :, :n].double())
    return out


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("kv_heads, group, head_dim",
                         [(3, 3, 64), (2, 1, 40), (1, 8, 128), (2, 16, 24), (1, 4, 256), (2, 2, 32)])
def test_kernel_matches_float64_attention(dtype, atol, kv_heads, group, head_dim):
    """Ragged lengths from 1 key to several split-K chunks (merged by the online-softmax rescaling), read through
    a strided view of a larger cache (as the backend passes it); head sizes off the vector width use the padded
    tail, 32 and 256 (Gemma 3) the bfloat16 path's smallest and largest row tiles. Error against float64 stays at
    the output's own rounding."""
    g = torch.Generator().manual_seed(head_dim)
    lens = torch.tensor([1, 700, 37, 2050], dtype=torch.int32)
    cache_k = torch.randn(6, kv_heads, 2100, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(6, kv_heads, 2100, head_dim, generator=g).to(dtype)
    k, v = cache_k[1:5, :, :2050], cache_v[1:5, :, :2050]
    q = torch.randn(4, kv_heads, group, head_dim, generator=g).to(dtype)
    out = torch.ops.kvcore.decode_attention(q, k, v, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - _reference(q, k, v, lens, head_dim**-0.5)).abs().max().item()
    assert err <= atol


def _prefill_reference(q, k, v, context_len, scale):
    """float64 causal attention of ``q [T, H, D]`` at positions ``context_len ..`` over ``k``/``v [H_kv, L, D]``."""
    group = q.shape[1] // k.shape[0]
    keys, values = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hld->htl", q.double(), keys) * scale
    hidden = torch.arange(k.shape[1])[None, :] > context_len + torch.arange(q.shape[0])[:, None]
    return torch.einsum("htl,hld->thd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values)


@pytest.fixture
def bf16_prefill(kernels):
    if not torch.ops.kvcore.built_with("avx512_bf16"):
        pytest.skip("kvcore's kernels were built without AVX512_BF16 (no bfloat16 prefill kernel)")


@pytest.mark.usefixtures("bf16_prefill")
@pytest.mark.parametrize("q_len, context_len, heads, kv_heads, head_dim",
                         [(5, 0, 9, 3, 64), (37, 11, 4, 2, 40), (64, 100, 8, 8, 128), (130, 0, 6, 1, 24),
                          (1, 7, 2, 1, 256), (300, 0, 9, 3, 64), (3, 61, 16, 1, 64)])
def test_prefill_kernel_matches_float64_attention(q_len, context_len, heads, kv_heads, head_dim):
    """Fresh and continued prefills (the causal mask aligned bottom-right), tiles and key blocks cut short, head
    sizes off the vector width, K/V read through strided views of a larger cache as the backend passes them: the
    error against float64 is that of bfloat16 outputs and probabilities, no larger than torch's bfloat16 SDPA's."""
    g = torch.Generator().manual_seed(q_len)
    seq_len = context_len + q_len
    q = torch.randn(q_len, heads, head_dim, generator=g).bfloat16()
    k = torch.randn(2, kv_heads, seq_len + 9, head_dim, generator=g).bfloat16()[1, :, :seq_len]
    v = torch.randn(2, kv_heads, seq_len + 9, head_dim, generator=g).bfloat16()[1, :, :seq_len]
    out = torch.ops.kvcore.prefill_attention(q, k, v, context_len, head_dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = _prefill_reference(q, k, v, context_len, head_dim**-0.5)
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 4e-3).all()
    mask = causal_mask(context_len, q_len, q.device) if q_len > 1 else None
    torch_out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                               scale=head_dim**-0.5, enable_gqa=True)[0].transpose(0, 1)
    assert err.max() <= 1.25 * (torch_out.double() - ref).abs().max()


@pytest.mark.usefixtures("bf16_prefill")
def test_prefill_kernel_rejects_bad_inputs_with_a_message():
    op = torch.ops.kvcore.prefill_attention
    q, k = torch.randn(4, 2, 64).bfloat16(), torch.randn(1, 6, 64).bfloat16()
    with pytest.raises(RuntimeError, match="L must be context_len \\+ T"):
        op(q, k, k, 1, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        op(q.float(), k.float(), k.float(), 2, 0.125)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        op(q, k, k, 2, 0.0)
    with pytest.raises(RuntimeError, match="H a multiple of H_kv"):
        op(torch.randn(4, 3, 64).bfloat16(), torch.randn(2, 6, 64).bfloat16(), torch.randn(2, 6, 64).bfloat16(), 2,
           0.125)


def test_the_library_is_built_with_the_extensions_python_chose():
    """csrc/isa.h decides per extension for every kernel file; built_with reports it, and it must agree with what
    cpu_kernels passed to the compiler for this CPU (a mismatch would run the slow paths, or crash on an
    instruction the CPU lacks). An unknown name is an error, not False."""
    from kvcore.kernels.cpu_kernels import extension_reasons, int8_dot_isa, load_kernels

    load_kernels()
    for feature in ("avx512_vnni", "avx512_bf16"):
        assert torch.ops.kvcore.built_with(feature) == (not extension_reasons(feature))
    assert torch.ops.kvcore.built_with("avx2_dot") == (int8_dot_isa() == "avx2_dot")
    with pytest.raises(RuntimeError, match="unknown feature 'avx512_fp16'"):
        torch.ops.kvcore.built_with("avx512_fp16")


def test_kernel_rejects_bad_inputs_with_a_message():
    q = torch.randn(2, 1, 2, 64)
    k = v = torch.randn(2, 1, 10, 64)
    op = torch.ops.kvcore.decode_attention
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        op(q, k, v, torch.tensor([3, 11], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="seq_lens must be int32"):
        op(q, k, v, torch.tensor([3, 4]), 0.125)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        op(q, k.bfloat16(), v, torch.tensor([3, 4], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 1..256"):
        op(torch.randn(2, 1, 2, 264), torch.randn(2, 1, 10, 264), torch.randn(2, 1, 10, 264),
           torch.tensor([3, 4], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_streams_equal_sdpa(dtype):
    """A ragged batch, eager and compiled: the same tokens as the sdpa backend (the decode kernel is the only
    difference). bfloat16 too, on this small random model, whose logits have no near-ties."""
    model = make_random_model(num_layers=2).to(getattr(torch, dtype))
    prompts = [[5, 9, 200, 31, 7], [8, 8, 120], [250, 3, 14, 15, 92, 65, 35]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    streams = {}
    for backend, compile_ in (("sdpa", False), ("cpu_decode", False), ("cpu_decode", True)):
        config = EngineConfig(backend=backend, dtype=dtype, max_num_seqs=3, max_model_len=64, compile=compile_)
        engine = Engine(model, None, config)
        streams[backend, compile_] = [r.token_ids for r in engine.generate(prompts, params)]
    assert streams["cpu_decode", False] == streams["sdpa", False]
    assert streams["cpu_decode", True] == streams["sdpa", False]


@pytest.mark.slow
@GOLDEN_TOKENS
def test_smollm2_matches_transformers(smollm2, num_tokens):
    """float32 greedy streams of all golden prompts, batched (ragged decode batches through the kernel), equal
    transformers' token for token, as every backend's must."""
    check_against_golden(smollm2, load_golden("golden_smollm2.json"), "cpu_decode", 11, num_tokens)


def test_passes_the_quick_conformance_suite():
    registry = PluginRegistry(load_entrypoints=False)
    report = run_suite("cpu_decode", SuiteConfig(quick=True, models=("tiny",)), registry=registry)
    assert report.status == PASS
    op = [r for r in report.results if r.tier == "op" and r.status == PASS]
    assert {r.case[-5:] for r in op} >= {"-bf16"}  # bfloat16 cases ran, float16 ones are declared unsupported
    assert any("compiled" in r.case for r in report.results if r.tier == "stream" and r.status == PASS)


def test_a_failed_build_is_one_clear_line(monkeypatch, tmp_path):
    import kvcore.kernels.cpu_kernels as ck

    for name in (*ck._SOURCES, *ck._HEADERS):
        (tmp_path / name).write_text("this is not C++\n")
    monkeypatch.setattr(ck, "_CSRC", tmp_path)
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(BackendUnavailableError, match=r"building kvcore's CPU kernels failed \(.*\): .*error") as e:
        ck.load_kernels.__wrapped__()
    assert "\n" not in str(e.value)


def test_no_compiler_makes_the_backend_unavailable_with_the_reason(monkeypatch):
    import kvcore.kernels.cpu_kernels as ck

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(ck.shutil, "which", lambda name: None)
    assert "no g++ or clang++ on PATH" in CPUDecodeBackend.availability()
    assert ck.vector_isa() in ("avx512", "avx2", "portable")

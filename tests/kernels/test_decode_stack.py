"""The native decode stack (csrc/decode_stack.cpp, ``CPUDecodeBackend.decode_stack``): layers 1.. of a fused int4a8
model in one operator call compute the per-layer path's hidden states, caches and tokens bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_random_model

from kvcore import Engine, EngineConfig, LlamaModel, SamplingParams
from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.cpu_decode import CPUDecodeBackend
from kvcore.backends.sdpa import SDPABackend
from kvcore.errors import BackendOutputError
from kvcore.execution.backend_check import BackendGuard
from kvcore.execution.runner import decode_stack_reasons, run_model
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.kernels.cpu_kernels import int4a8_reasons, load_kernels
from kvcore.loaders import expected_shapes

pytestmark = pytest.mark.skipif(bool(int4a8_reasons()), reason="; ".join(int4a8_reasons()))



@pytest.fixture(scope="module", autouse=True)
def kernels():
    return load_kernels()


HEAD_DIM = 64
NUM_LAYERS = 4


def _model(layers: tuple[LayerAttention, ...] | None = None, dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
    """A random 4-layer int4a8 model (4 query heads, 2 KV heads of 64) in ``dtype``, each layer attending as
    ``layers`` says."""
    config = dataclasses.replace(make_random_model(num_layers=NUM_LAYERS, head_dim=HEAD_DIM).config,
                                 intermediate_size=256, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=gen) * (0.3 if "embed" in name else shape[1] ** -0.5)
               if len(shape) == 2 else 1.0 + 0.1 * torch.randn(shape, generator=gen)
               for name, shape in expected_shapes(config).items()}
    model = LlamaModel.from_weights(config, weights, dtype, weight_format="int4a8")
    assert model.fused_layers
    if layers is not None:
        model.attention_layers = layers
    return model


SCALE = HEAD_DIM**-0.5
#: a sliding window, a soft-cap, plain layers: the variants the kernel takes
VARIANT_LAYERS = (LayerAttention(SCALE), LayerAttention(SCALE, sliding_window=5),
                  LayerAttention(SCALE * 4, softcap=2.0), LayerAttention(SCALE))

#: (query_lens, context_lens) of consecutive calls, sequence i on slot i + 1: prefills; a ragged decode batch of 3
#: on consecutive slots; one sequence's decode; verifications of 5 and 3 rows (a call group each); a decode past
#: one split-K chunk
STEPS = [([12, 7, 300], [0, 0, 0]), ([1, 1, 1], [12, 7, 300]), ([1], [13]), ([5, 3], [14, 8]),
         ([1, 1, 1], [19, 11, 301])]


def _run(model: LlamaModel, backend: CPUDecodeBackend, steps=STEPS):
    """Each call's hidden states, and the caches after the last."""
    spec = CacheSpec(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=HEAD_DIM, dtype=model.dtype,
                     device=torch.device("cpu"), max_num_seqs=4, max_seq_len=512)
    cache, gen, hidden = ContiguousKVCache(spec), torch.Generator().manual_seed(1), []
    for query_lens, context_lens in steps:
        tables = [[i + 1] for i in range(len(query_lens))]
        meta = AttentionMetadata.build(query_lens, context_lens, tables, cache.block_size, SCALE,
                                       torch.device("cpu"), model.attention_layers)
        ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=gen)
        hidden.append(run_model(model, backend, cache, meta, ids))
    return hidden, (cache.k.clone(), cache.v.clone())


def _backend(native: bool) -> CPUDecodeBackend:
    backend = CPUDecodeBackend()
    backend.native_stack = native
    return backend


@pytest.fixture
def stack_calls(monkeypatch):
    """The token count of each decode_stack call."""
    op, calls = torch.ops.kvcore.decode_stack, []
    monkeypatch.setattr(torch.ops.kvcore, "decode_stack", lambda h, *args: calls.append(h.shape[0]) or op(h, *args))
    return calls


def _same(a, b) -> bool:
    (hidden_a, caches_a), (hidden_b, caches_b) = a, b
    return all(map(torch.equal, hidden_a, hidden_b)) and all(map(torch.equal, caches_a, caches_b))


@pytest.fixture(autouse=True)
def one_thread(request):
    """One thread unless a test asks for more: on a busy machine every parallel region of a few-row step can wait
    a scheduler slice for its second thread, which makes these small steps seconds long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(getattr(request, "param", 1))
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("one_thread", [1, 2], indirect=True, ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("layers", [None, VARIANT_LAYERS], ids=["plain", "window-softcap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_stack_computes_the_per_layer_path_bit_for_bit(layers, dtype, stack_calls, one_thread):
    """The call groups' attention splits the context by the thread count: both counts, the same results, in both
    activation dtypes."""
    model = _model(layers, dtype)
    native = _run(model, _backend(True))
    assert stack_calls == [3, 1, 8, 3]  # every call but the prefills
    assert _same(native, _run(model, _backend(False)))


@pytest.mark.parametrize("bug", ["layer skipped", "K/V rows of another layer"])
def test_a_planted_bug_is_caught(bug, monkeypatch):
    """The comparison sees the stack running one layer too few, or writing a layer's K/V where another's go."""
    model = _model(VARIANT_LAYERS)
    op = torch.ops.kvcore.decode_stack

    def planted(h, delta, first, *args):
        args = list(args)
        if bug == "layer skipped":
            first += 1
        else:  # the call groups' rows (argument 19 of the operator)
            args[16] = [rows.roll(1, 0) for rows in args[16]]
        return op(h, delta, first, *args)

    monkeypatch.setattr(torch.ops.kvcore, "decode_stack", planted)
    assert not _same(_run(model, _backend(True)), _run(model, _backend(False)))


def test_calls_the_backend_cannot_describe_keep_the_per_layer_path(stack_calls):
    """A layer with attention sinks (sdpa's path), a call mixing a prefill chunk with short rows, the backend's
    switch off: no stack call, the per-layer results."""
    sinks = (*VARIANT_LAYERS[:3], LayerAttention(SCALE, sinks=torch.linspace(-1.0, 1.0, 4)))
    steps = STEPS[:2]
    _run(_model(sinks), _backend(True), steps)
    _run(_model(), _backend(True), [([12, 7], [0, 0]), ([20, 3], [12, 7])])
    _run(_model(), _backend(False), steps)
    assert stack_calls == []


def test_greedy_streams_equal_the_per_layer_path(stack_calls, monkeypatch):
    """The engine on cpu_decode: three sequences decoded together, then one alone, the same tokens."""
    model = _model()
    prompts = [[5, 9, 200, 31, 7], [8, 8, 120], [250, 3, 14, 15, 92, 65, 35]]
    streams = []
    for native in (True, False):
        stack_calls.clear()
        monkeypatch.setattr(CPUDecodeBackend, "native_stack", native)
        engine = Engine(model, None, EngineConfig(backend="cpu_decode", dtype="bfloat16", max_num_seqs=3,
                                                  max_model_len=64))
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        streams.append([r.token_ids for r in engine.generate(prompts, params)] +
                       [engine.generate([prompts[0]], params)[0].token_ids])
        assert bool(stack_calls) == native
    assert streams[0] == streams[1]


def test_speculative_verification_takes_the_stack(stack_calls, monkeypatch):
    """ngram drafts on a repeating prompt: the verification steps' rows (several per sequence) run as the stack, and
    the accepted tokens are those of the per-layer path."""
    model = _model()
    prompt = [7, 8, 9, 10, 11] * 4
    streams = []
    for native in (True, False):
        stack_calls.clear()
        monkeypatch.setattr(CPUDecodeBackend, "native_stack", native)
        engine = Engine(model, None, EngineConfig(backend="cpu_decode", dtype="bfloat16", max_num_seqs=2,
                                                  max_model_len=96, proposer="ngram"))
        streams.append(engine.generate([prompt, prompt[3:]], SamplingParams(max_new_tokens=12, ignore_eos=True)))
        assert (max(stack_calls, default=0) > 2) == native  # more rows than sequences: drafts were verified
    assert [r.token_ids for r in streams[0]] == [r.token_ids for r in streams[1]]


class _TransposingBackend(CPUDecodeBackend):
    """cpu_decode whose layer-0 decode output has the right size and the wrong layout."""

    name = "planted"
    described = 0  # calls described as a stack

    def decode_stack(self, plan, cache):
        stack = super().decode_stack(plan, cache)
        self.described += stack is not None
        return stack

    def forward(self, layer_idx, q, k, v, cache, plan):
        out = super().forward(layer_idx, q, k, v, cache, plan)
        return out.transpose(1, 2).reshape(out.shape) if layer_idx == 0 and plan.meta.is_decode else out


def test_the_backend_check_still_verifies_layer_0():
    """With the stack on, layer 0's attention still goes through the backend and its check: a wrong layout there
    fails the request on its first decode step (in layer 0, before the stack runs) instead of becoming tokens."""
    engine = Engine(_model(), None, EngineConfig(backend="cpu_decode", dtype="bfloat16", max_model_len=64))
    engine.decode_backend = backend = _TransposingBackend()
    engine.runner.guards[id(backend)] = BackendGuard(backend)
    result = engine.generate([[5, 9, 200]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert isinstance(result.error, BackendOutputError) and "wrong attention output (decode, layer 0" in str(
        result.error)
    assert backend.described == 1  # the failed step was one the stack would have run


def _op_args(model: LlamaModel):
    """Valid decode_stack arguments for one decode row of one sequence on slot 0 after 10 keys."""
    c, d = model.config, model.config.hidden_size
    q = model._quantized
    weights = [[getattr(w, attr) for w in q[name]] for name in ("qkv", "o", "gate_up", "down")
               for attr in ("codes", "dm")]
    cos, sin = model.rotary.tables(torch.tensor([10]), torch.bfloat16)
    caches = [torch.zeros(NUM_LAYERS, 2, 2, 32, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    rows = torch.arange(NUM_LAYERS)[:, None] * (2 * 2 * 32) + torch.tensor([10, 32 + 10])[None, :]
    return [torch.randn(1, d).bfloat16(), None, 0, list(model.input_norm), list(model.post_norm), c.rms_norm_eps,
            *weights, [cos] * NUM_LAYERS, [sin] * NUM_LAYERS, c.num_attention_heads, *caches, [rows],
            [torch.tensor([11], dtype=torch.int32)], [0], [11], [SCALE] * NUM_LAYERS, [0] * NUM_LAYERS,
            [0.0] * NUM_LAYERS]


@pytest.mark.parametrize("index, value, message", [
    (4, "drop", "post_norms must have one entry per layer"),
    (2, 4, "first_layer must be 0..3"),
    (16, 6, "layer 0's Q/K/V must be 6 \\+ 2 x 2 heads"),
    (19, "rows 999", "row 999999 out of range"),
    (20, "seq_len 40", "seq_lens out of range 1..11"),
    (19, "17 tokens", "1..16 query tokens per sequence"),
    (17, "float cache", "caches must be contiguous \\[L, S, H_kv, S_max, D\\] of h's dtype"),
    (25, "negative window", "window and softcap must be >= 0"),
])
def test_bad_arguments_are_refused_with_a_message(index, value, message):
    model = _model()
    args = _op_args(model)
    assert torch.ops.kvcore.decode_stack(*args).shape == (1, model.config.hidden_size)  # the valid call runs
    if value == "drop":
        args[4] = args[4][:-1]
    elif value == "rows 999":
        args[19] = [torch.full_like(args[19][0], 999_999)]
    elif value == "seq_len 40":
        args[20] = [torch.tensor([40], dtype=torch.int32)]
    elif value == "17 tokens":
        args[0] = torch.randn(17, model.config.hidden_size).bfloat16()
        args[19] = [torch.zeros(NUM_LAYERS, 17 * 2, dtype=torch.long)]
        args[14:16] = [[t] * NUM_LAYERS for t in model.rotary.tables(torch.arange(10, 27), torch.bfloat16)]
    elif value == "float cache":
        args[17] = args[17].float()
    elif value == "negative window":
        args[25] = [-1] * NUM_LAYERS
    else:
        args[index] = value
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvcore.decode_stack(*args)


def test_the_reasons_say_why_no_stack_runs():
    model = _model()
    assert decode_stack_reasons(model, _backend(True)) == []
    assert decode_stack_reasons(model, _backend(False)) == [
        "backend 'cpu_decode' has its native stack switched off (native_stack)"]
    assert decode_stack_reasons(model, SDPABackend()) == [
        "backend 'sdpa' does not describe its attention as a native stack (capabilities.decode_stack)"]
    described = dataclasses.replace(SDPABackend.capabilities, decode_stack=True)
    plugin = type("Plugin", (SDPABackend,), {"name": "plugin", "capabilities": described})
    assert decode_stack_reasons(model, plugin()) == []  # the default follows the capability
    switched = type("Switched", (plugin,), {"decode_stack_reason": lambda self: "its kernels are not built yet"})
    assert decode_stack_reasons(model, switched()) == ["its kernels are not built yet"]  # a backend's own reason
    model.fused_layers = False
    assert decode_stack_reasons(model, _backend(True)) == ["the model's fused layers are switched off"]
    dense = make_random_model(num_layers=1, head_dim=HEAD_DIM, dtype=torch.bfloat16)
    assert decode_stack_reasons(dense, _backend(True)) == [
        "the fused layers run int4a8 weights with bfloat16 or float32 activations on CPU",
        "every layer matmul must run on the int4a8 kernel"]

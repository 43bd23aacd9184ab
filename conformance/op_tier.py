"""Op tier: one backend's attention output vs the reference, call by call, on the case matrix.

The backend under test writes into the cache under test (each cache of ``Target.cache_names``); the
reference (``naive``) writes into a float32 ``ContiguousKVCache`` and is fed the same q/k/v (rounded to
the test dtype, then upcast). The backend's plan is made once per call, as the engine does. After the
script, every sequence's cached K/V (``cache.read``) must equal what was written.
"""

from __future__ import annotations

import inspect

import torch

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.naive import NaiveBackend
from kvcore.conformance.attention_cases import case_layers, case_variants, variant_cases
from kvcore.conformance.cases import NUM_LAYERS, OpCase, on_caches, op_cases
from kvcore.conformance.compare import compare
from kvcore.conformance.results import FAIL, CaseResult
from kvcore.conformance.scenarios import Fork
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import Target
from kvcore.conformance.tolerances import op_tolerance
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.scheduling.kv_manager import KVCacheManager

__all__ = ["NAME", "cases", "tolerance", "skip_reasons", "check"]

NAME = "op"
TITLE = "Op level: attention output vs the reference"
_SEQ_ID_BASE = 100  # the case's sequence ids (not 0..B-1, so seq_id == slot assumptions show)
_DUMMY_ID_BASE = 10_000
_GARBAGE = 50.0
_LONG_V_MEAN = 1.0  # magnitude of the K/V the fragmenting sequences leave behind


def cases(target: Target, cfg: SuiteConfig) -> list[OpCase]:
    """The op matrix and the variant rows, over the caches under test: in ``quick`` each case on one of them, the
    turns taken over both lists together (:func:`~kvcore.conformance.cases.on_caches`)."""
    selected = [target.registry.create_variant(name) for name in cfg.attention_variants]
    both = op_cases(cfg.quick, None, cfg.dtypes) + variant_cases(None, cfg.dtypes, selected)
    return on_caches(both, target.cache_names(), cfg.quick)


def skip_reasons(target: Target, case: OpCase, cfg: SuiteConfig) -> list[str]:
    caps = target.capabilities
    reasons = caps.reasons_unsupported(
        device=cfg.torch_device,
        dtype=cfg.dtype,
        head_dim=case.head_dim,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
    )
    if not caps.supports_prefill:
        reasons.append("backend declares no prefill support (every op case starts with a prefill)")
    if not caps.supports_decode:
        reasons.append("backend declares no decode support")
    reasons += caps.reasons_variants(case_variants(case))
    names = target.cache_names()
    if names:
        name = _cache_name(target, case)
        reasons += [f"KV cache '{name}': {r}" for r in target.cache_class(name).capabilities.reasons_unsupported(
            device=cfg.torch_device, dtype=cfg.dtype)]
    return reasons


def _fragment(kv: KVCacheManager, gen: torch.Generator, scale: float) -> list[int]:
    """Fill the cache with one-block sequences holding garbage, then free a random 3/4 of them in random
    order. Returns the ids still live (they stay, interleaved with the holes the case will use)."""
    spec, block_size = kv.cache.spec, kv.blocks.block_size
    dummies = []
    while len(dummies) < 4096 and kv.can_add_sequence():
        seq_id = _DUMMY_ID_BASE + len(dummies)
        kv.add_sequence(seq_id)
        if not kv.can_reserve([seq_id], [block_size]):
            kv.free_sequence(seq_id)
            break
        dummies.append(seq_id)
        meta = kv.prepare([seq_id], [block_size], scale)
        shape = (block_size, spec.num_kv_heads, spec.head_dim)
        for layer in range(spec.num_layers):
            k = (torch.randn(shape, generator=gen) * _GARBAGE).to(spec.dtype).to(spec.device)
            v = (torch.randn(shape, generator=gen) * _GARBAGE).to(spec.dtype).to(spec.device)
            kv.cache.write(layer, k, v, meta)
    order = torch.randperm(len(dummies), generator=gen).tolist()
    keep = set(order[: len(dummies) // 4])
    for i in order:
        if i not in keep:
            kv.free_sequence(dummies[i])
    return [dummies[i] for i in sorted(keep)]


def _describe_call(call_idx: int, num_calls: int, seq_idx, query_lens, context_lens) -> str:
    if max(query_lens) == 1 and min(context_lens) > 0:
        kind = "decode"
    elif min(context_lens) == 0 and max(context_lens) == 0:
        kind = "prefill"
    elif any(q == 1 and c > 0 for q, c in zip(query_lens, context_lens)):
        kind = "mixed: prefill chunks and decode rows"
    else:
        kind = "prefill continuing the cache"
    return (
        f"call {call_idx + 1}/{num_calls} ({kind}; seqs {list(seq_idx)}, query_lens {list(query_lens)}, "
        f"context_lens {list(context_lens)})"
    )


def _layer_label(layers: tuple[LayerAttention, ...], layer: int) -> str:
    """``layer 1``, or on a variant case ``layer 1 (window 61)``: which attention the failing layer had."""
    if not layers:
        return f"layer {layer}"
    spec = layers[layer]
    return f"layer {layer} ({spec.describe().partition(', ')[2] or 'plain causal'})"


def _row_label(layers: tuple[LayerAttention, ...], layer: int, seq: int, row: int, pos: int) -> str:
    """``seq 0 (query row 0, position 2100, window keys 2040..2100)``: where an element is, and on a windowed
    layer which keys that query row may see."""
    window = layers[layer].sliding_window if layers else None
    keys = f", window keys {max(0, pos - window + 1)}..{pos}" if window is not None else ""
    return f"seq {seq} (query row {row}, position {pos}{keys})"


def _locate(packed_row: int, query_lens: list[int], context_lens: list[int]) -> tuple[int, int, int]:
    """A row of the call's packed ``[T, H, D]`` output -> (its sequence's index in the call, query row, position)."""
    b, start = 0, 0
    while start + query_lens[b] <= packed_row:
        start += query_lens[b]
        b += 1
    return b, packed_row - start, context_lens[b] + packed_row - start


def _cache_name(target: Target, case: OpCase) -> str:
    return case.kv_cache or target.cache_names()[0]


def _roundoff(target: Target, case: OpCase) -> float:
    return target.cache_class(_cache_name(target, case)).capabilities.unit_roundoff or 0.0


def _tolerance(target: Target, case: OpCase, cfg: SuiteConfig):
    return op_tolerance(cfg.dtype, _roundoff(target, case), head_dim=case.head_dim, num_keys=max(case.final_lens))


def tolerance(target: Target, case: OpCase, cfg: SuiteConfig) -> str:
    return str(_tolerance(target, case, cfg))


def _make_cache(target: Target, case: OpCase, spec: CacheSpec):
    """The cache under test with the case's block size: as ``spec.block_size`` and, when the cache takes a
    ``block_size`` option the user did not fix, as that option too."""
    name = _cache_name(target, case)
    cls = target.cache_class(name)
    fixed = name == target.kv_cache and "block_size" in target.kv_cache_options
    if not fixed and "block_size" in inspect.signature(cls.__init__).parameters:
        options = {**(target.kv_cache_options if name == target.kv_cache else {}), "block_size": case.block_size}
        return target.registry.create_cache(name, spec, options)
    return target.make_cache(name, spec)


def check(target: Target, case: OpCase, cfg: SuiteConfig, result: CaseResult) -> None:
    result.info["shapes"] = case.shapes()
    _run(target, case, cfg, result)


@torch.inference_mode()
def _run(target: Target, case: OpCase, cfg: SuiteConfig, result: CaseResult) -> None:
    dtype, device = cfg.dtype, cfg.torch_device
    H, H_kv, D = case.num_heads, case.num_kv_heads, case.head_dim
    scale = D**-0.5
    layers = case_layers(case, scale)  # the attention-variant dimension (attention_cases.py); () for plain cases
    n = case.num_seqs
    max_len = max(case.final_lens) + max(case.block_size, 16)  # slack: a write past the end lands in real memory
    spec = CacheSpec(
        num_layers=NUM_LAYERS,
        num_kv_heads=H_kv,
        head_dim=D,
        dtype=dtype,
        device=device,
        max_num_seqs=2 * n if case.fragment else n,
        max_seq_len=max_len,
        block_size=case.block_size,
    )
    backend = target.make()
    cache = KVCacheManager(_make_cache(target, case, spec))
    result.info["kv_cache"] = cache.cache.name
    result.info["block_size"] = cache.cache.block_size if cache.cache.paged else None
    ref_spec = CacheSpec(
        num_layers=NUM_LAYERS, num_kv_heads=H_kv, head_dim=D, dtype=torch.float32, device=device,
        max_num_seqs=n, max_seq_len=max_len, block_size=16,
    )
    ref_cache, ref = KVCacheManager(ContiguousKVCache(ref_spec)), NaiveBackend()
    gen = torch.Generator().manual_seed(case.seed)
    if case.fragment:
        result.info["where"] = "fragmenting the cache"
        result.info["live_dummies"] = len(_fragment(cache, gen, scale))

    tol = _tolerance(target, case, cfg)
    # Long contexts: values with mean 1, so outputs stay O(1); a zero-mean average over thousands of keys
    # shrinks toward 0 and would hide a long reduction's rounding error under atol.
    v_mean = _LONG_V_MEAN if max(case.final_lens) > 1024 else 0.0
    calls = case.calls
    started: set[int] = set()
    worst = 0.0
    for call_idx, call in enumerate(calls):
        if isinstance(call, Fork):
            result.info["where"] = f"step {call_idx + 1}/{len(calls)}: fork of seq {call.src} into seq {call.dst}"
            cache.fork_sequence(_SEQ_ID_BASE + call.src, _SEQ_ID_BASE + call.dst)
            ref_cache.fork_sequence(call.src, call.dst)
            started.add(call.dst)
            continue
        seq_idx = [i for i, _ in call]
        query_lens = [q for _, q in call]
        for i in seq_idx:
            if i not in started:
                started.add(i)
                cache.add_sequence(_SEQ_ID_BASE + i)
                ref_cache.add_sequence(i)
        context_lens = [ref_cache.seq_len(i) for i in seq_idx]
        where = _describe_call(call_idx, len(calls), seq_idx, query_lens, context_lens)
        result.info["where"] = where
        meta = cache.prepare([_SEQ_ID_BASE + i for i in seq_idx], query_lens, scale, layers)
        plan = backend.plan(meta, cache.cache)
        ref_meta = ref_cache.prepare(seq_idx, query_lens, scale, layers)
        T = sum(query_lens)
        for layer in range(NUM_LAYERS):
            layer_label = _layer_label(layers, layer)
            result.info["where"] = f"{where} {layer_label}"
            q = torch.randn((T, H, D), generator=gen).to(dtype)
            k = torch.randn((T, H_kv, D), generator=gen).to(dtype)
            v = (torch.randn((T, H_kv, D), generator=gen) + v_mean).to(dtype)
            ref_out = ref.forward(layer, q.float().to(device), k.float().to(device), v.float().to(device),
                                  ref_cache.cache, ref_meta)
            out = backend.forward(layer, q.to(device), k.to(device), v.to(device), cache.cache, plan)
            if tuple(out.shape) != (T, H, D) or out.dtype != dtype:
                result.status = FAIL
                result.detail = (
                    f"{where} {layer_label}: output has shape {tuple(out.shape)} dtype {out.dtype}, "
                    f"expected {(T, H, D)} {dtype}"
                )
                return
            m = compare(out, ref_out, tol)
            worst = max(worst, m.max_err)
            result.max_err = worst
            if not m.ok:
                row, head, dim = m.worst_index
                b, qrow, pos = _locate(row, query_lens, context_lens)
                first = ""
                if m.first_index[0] != row:  # the bug starts acting before its worst row: say where
                    fb, fq, fpos = _locate(m.first_index[0], query_lens, context_lens)
                    first = (f"; first off at {_row_label(layers, layer, seq_idx[fb], fq, fpos)} head "
                             f"{m.first_index[1]} dim {m.first_index[2]}: got {m.first_out:.5g}, expected "
                             f"{m.first_ref:.5g}")
                result.status = FAIL
                result.max_err = m.max_err
                result.detail = (
                    f"{where} {layer_label}: attention output diverges from the reference: max |err| "
                    f"{m.max_err:.3g} ({tol}); {m.num_bad}/{m.numel} elements off; worst at "
                    f"{_row_label(layers, layer, seq_idx[b], qrow, pos)} head {head} (KV head "
                    f"{head // (H // H_kv)}) dim {dim}: got {m.out_value:.5g}, expected {m.ref_value:.5g}{first}. "
                    f"Shapes: H={H} H_kv={H_kv} D={D} dtype={cfg.dtype_name} cache={cache.cache.name}"
                )
                result.info.update(call=call_idx, layer=layer, seq=seq_idx[b], position=pos, head=head,
                                   num_bad=m.num_bad)
                return

    result.info["where"] = "reading the cache back"
    for i in sorted(started):
        for layer in range(NUM_LAYERS):
            k_got, v_got = cache.read(layer, _SEQ_ID_BASE + i)
            k_ref, v_ref = ref_cache.read(layer, i)
            for what, got, want in (("K", k_got, k_ref), ("V", v_got, v_ref)):
                if got.shape != want.shape:
                    result.status = FAIL
                    result.detail = (
                        f"after the last call: cache.read(layer {layer}, seq {i}) returned {what} of shape "
                        f"{tuple(got.shape)}, expected {tuple(want.shape)}"
                    )
                    return
                m = compare(got, want, tol)
                if not m.ok:
                    pos, head, dim = m.worst_index
                    result.status = FAIL
                    result.max_err = max(worst, m.max_err)
                    result.detail = (
                        f"after the last call: cached {what} of seq {i} layer {layer} differs from what was "
                        f"written: {m.num_bad}/{m.numel} elements off, first bad at position {pos} KV head {head}: "
                        f"got {m.out_value:.5g}, expected {m.ref_value:.5g} (cache={cache.cache.name})"
                    )
                    result.info.update(layer=layer, seq=i, position=pos)
                    return
    result.detail = f"{len(calls)} calls x {NUM_LAYERS} layers, max |err| {worst:.3g} ({tol})"

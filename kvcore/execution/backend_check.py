"""Checks at the backend boundary: what an attention backend hands back must keep its contract.

A backend's ``forward`` returns ``[T, H, D]`` in the model dtype on the query's device. A broken backend
(NaN or inf, a transposed or mis-strided result of the right size, the wrong dtype or shape) would
otherwise turn into plausible-looking wrong tokens: NaN logits make greedy decoding pick token 0. The
engine runs every forward through a :class:`BackendGuard`, which raises :class:`BackendOutputError`
(the batch fails; other requests go on, as for a sampler error):

- every layer: shape, dtype and device, compared in Python (no device work);
- once per step: the finiteness of layer 0's output and of the logits, as one 0-dim flag on the device
  read with one sync right before the sampler (which syncs at that point anyway). NaN or inf from any
  later layer reaches the logits, so it is caught there (the message then says layer 0 was finite).
  Sequences do not mix in a forward, so when only some sequences are not finite, only they fail
  (:class:`~kvcore.errors.NonFiniteRowsError`: the engine samples the others);
  Checking every layer's output would cost three small device ops per layer and step, a visible share of a
  small model's decode step;
- the first forward of each kind a backend serves (prefill, continued prefill, decode), then every
  ``verify_every`` steps: layer 0's output for one sequence against a float32 reference computed from
  the queries and what the cache holds (textbook attention, bottom-right causal mask, with layer 0's
  window, soft-cap, sinks and variants as code). This catches a
  result of the right shape with the wrong layout, which no shape check can.
"""

from __future__ import annotations

import torch

from kvcore.errors import BackendOutputError, NonFiniteRowsError
from kvcore.interfaces.attention import AttentionBackend, causal_mask, explicit_attention
from kvcore.interfaces.dtypes import dtype_name
from kvcore.interfaces.kv_cache import KVCache
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.metadata import AttentionMetadata
from kvcore.kernels.cpu_kernels import kernels_loaded

__all__ = ["BackendGuard", "reference_attention"]


def _all_finite(out0: torch.Tensor, logits: torch.Tensor) -> bool:
    """Usually True: both tensors are finite; False: one may not be (checked element-wise next)."""
    if kernels_loaded() and out0.device.type == logits.device.type == "cpu":
        return torch.ops.kvcore.all_finite([out0, logits])  # one pass, one operator (csrc/logits.cpp)
    # A sum is finite only if every term is (a NaN or inf propagates), so the two tensors' sums added usually
    # settle it in one flag; a non-finite total is checked element-wise (finite values may overflow it).
    return bool((out0.sum() + logits.sum()).isfinite())


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, layer: LayerAttention | float, row: int = 0
):
    """Float32 attention of one sequence (row ``row`` of its call): ``q [n, H, D]`` against ``k, v
    [context_len + n, H_kv, D]``, query ``i`` at position ``context_len + i``, as ``layer`` attends (a float:
    plain causal at that scale); returns ``[n, H, D]`` float32."""
    layer = layer if isinstance(layer, LayerAttention) else LayerAttention(layer)
    mask = causal_mask(context_len, q.shape[0], q.device, layer.sliding_window)
    out = explicit_attention(q.float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             mask, layer, at=(row, context_len))  # (1, H, n, D)
    return out[0].transpose(0, 1)


class BackendGuard:
    """Checks one backend's outputs; one guard per backend instance of an engine (it remembers which kinds of
    forward it has verified against the reference)."""

    #: relative tolerance of the reference check, as a fraction of the sequence's largest |V| (an attention
    #: output is a convex combination of V rows); a wrong layout is off by the order of |V| itself
    RTOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}

    def __init__(self, backend: AttentionBackend, verify_every: int = 256) -> None:
        self.backend = backend
        self.verify_every = verify_every
        self._verified: set[str] = set()
        self._calls = 0

    def begin(self, meta: AttentionMetadata, cache: KVCache) -> _StepCheck:
        """The check of one forward (call :meth:`_StepCheck.observe` per layer, then :meth:`_StepCheck.finish`)."""
        self._calls += 1
        kind = "decode" if meta.is_decode else ("prefill" if max(meta.context_lens) == 0 else "continued prefill")
        verify = kind not in self._verified or self._calls % self.verify_every == 0
        self._verified.add(kind)
        return _StepCheck(self, meta, cache, verify, kind)


class _StepCheck:
    def __init__(self, guard: BackendGuard, meta: AttentionMetadata, cache: KVCache, verify: bool, kind: str):
        self.guard, self.meta, self.cache, self.verify, self.kind = guard, meta, cache, verify, kind
        self.out0: torch.Tensor | None = None  # layer 0's attention output

    def _fail(self, message: str) -> BackendOutputError:
        return BackendOutputError(f"backend '{self.guard.backend.name}' {message}")

    def observe(self, layer: int, q: torch.Tensor, out: object) -> None:
        """One layer's output; raises at once for a wrong type, shape, dtype or device (no device sync)."""
        if not isinstance(out, torch.Tensor):
            raise self._fail(f"returned {type(out).__name__} from forward, not a tensor (layer {layer})")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            got = f"{list(out.shape)} {dtype_name(out.dtype)} on {out.device}"
            want = f"{list(q.shape)} {dtype_name(q.dtype)} on {q.device}"
            raise self._fail(f"returned {got} from forward at layer {layer}; the contract is [T, H, D] = {want}")
        if layer == 0:
            self.out0 = out
            if self.verify:
                self._verify(q, out)

    def _verify(self, q: torch.Tensor, out: torch.Tensor) -> None:
        meta = self.meta
        i = len(meta.query_lens) - 1  # the last sequence: in a mixed batch, a prefill's
        start, n = int(meta.cu_seqlens_q[i]), meta.query_lens[i]
        k, v = self.cache.read(0, meta.for_layer(0).block_tables[i], meta.seq_lens[i])
        ref = reference_attention(q[start : start + n], k, v, meta.context_lens[i], meta.layer(0), row=i)
        got = out[start : start + n].float()
        if not bool(torch.isfinite(got).all()):
            return  # finish() fails the sequences that are not finite, and only them
        rtol = self.guard.RTOL.get(q.dtype, 5e-2)
        unit = self.cache.capabilities.unit_roundoff
        if unit is not None:  # a lossy cache: the backend may attend to this call's exact K/V
            rtol = max(rtol, 64 * unit)
        bound = rtol * float(v.float().abs().max()) + 1e-6
        err = float((got - ref).abs().max()) if got.numel() else 0.0
        if not err <= bound:  # NaN compares False
            raise self._fail(
                f"returned a wrong attention output ({self.kind}, layer 0, sequence {i}): max |error| {err:.3g} "
                f"against the reference, allowed {bound:.3g} (wrong layout, transposed heads, or a kernel bug?)"
            )

    def finish(self, logits: torch.Tensor, rows: list[int] | None = None) -> None:
        """One host sync per step: layer 0's attention output and the logits must be finite. ``logits`` row
        ``j`` is sequence ``rows[j]`` of the batch (every sequence in order without ``rows``)."""
        if self.out0 is None:
            return
        if _all_finite(self.out0, logits):
            return
        out0_ok = bool(torch.isfinite(self.out0).all())
        logits_ok = bool(torch.isfinite(logits).all())
        if out0_ok and logits_ok:
            return
        num_seqs = len(self.meta.query_lens)
        rows = list(range(num_seqs)) if rows is None else list(rows)
        bad0 = set()
        if not out0_ok:
            token_ok = torch.isfinite(self.out0).flatten(1).all(dim=1).tolist()
            cu = self.meta.cu_seqlens_q.tolist()
            bad0 = {i for i in range(num_seqs) if not all(token_ok[cu[i]:cu[i + 1]])}
        bad_logits = set()
        if not logits_ok:
            row_ok = torch.isfinite(logits).all(dim=1).tolist()
            bad_logits = {rows[j] for j, ok in enumerate(row_ok) if not ok}
        bad = sorted(bad0 | bad_logits)
        if bad0:
            message = self._fail(f"returned NaN or inf from forward ({self.kind}, layer 0)")
        else:
            message = BackendOutputError(
                f"NaN or inf logits with backend '{self.guard.backend.name}' ({self.kind}): its layer-0 output was "
                "finite, so a later layer's attention output or the model's activations are not (in float16, "
                "try bfloat16 or float32)"
            )
        if len(bad) == num_seqs:
            raise message
        raise NonFiniteRowsError(f"{message} (sequence {', '.join(map(str, bad))} of {num_seqs} in the batch)",
                                 bad, logits)

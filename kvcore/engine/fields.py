"""The engine's and the run's settings, each declared once as a field (:func:`~kvcore.interfaces.setting.setting`).

:class:`EngineFields` holds :class:`~kvcore.engine.config.EngineConfig`'s fields, which adds the checks that
need torch; :class:`RunFields` the settings of a run that belong to neither the engine nor a request.
:data:`SETTINGS` names the dataclasses the config file's keys and the command line's flags are derived from.
No torch here: the command line reads these before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.interfaces.sampler import SamplingParams
from kvcore.interfaces.setting import setting

__all__ = ["EngineFields", "RunFields", "SETTINGS"]

_WEIGHT_FORMATS = ("auto", "float", "int8", "int4", "int4a8", "gguf")  # kvcore.kernels.quant.WEIGHT_FORMATS
_LM_HEADS = ("auto", "dense", "int4", "int8")  # kvcore.model.lm_head.LM_HEAD_FORMATS


@dataclass
class EngineFields:
    """How the engine runs. Names left ``None`` mean "pick the best available"; ``"auto"`` settings are decided
    by :mod:`kvcore.engine.defaults`, which says why."""

    backend: str | None = setting(None, help="attention backend for both phases (see `kvcore backends`)")
    prefill_backend: str | None = setting(None, help="backend for prefill (overrides --backend)")
    decode_backend: str | None = setting(None, help="backend for decode (overrides --backend)")
    kv_cache: str | None = setting(None, help="KV cache (`kvcore plugins`; default: the backend's layout)")
    sampler: str = setting("default", help="sampler (see `kvcore plugins`; default '{default}')")
    dtype: str = setting("auto", help="auto (default: float32; bfloat16 only for weights on torch's int4/int8 "
                                      "kernels), float32 (given: the exact reference, dense weights), bfloat16 "
                                      "(with --lm-head int4: the fastest, less accurate) or float16")
    device: str = setting("cpu", help="torch device (default {default})")
    weights: str = setting(
        "auto", choices=_WEIGHT_FORMATS,
        help="matmul weights: auto (default: a Q4 GGUF's blocks as int4a8, else int4, a K-quant GGUF's as gguf; "
             "else float), float, int8 or int4 (weight-only quantized, torch's kernels: bfloat16 on CPU), int4a8 "
             "(int4 with int8 activations, kvcore's kernel, AVX512-VNNI or AVX2), gguf (a GGUF's blocks as stored, "
             "int8 activations); int4a8 and gguf take float32 or bfloat16 activations")
    lm_head: str = setting(
        "auto", choices=_LM_HEADS,
        help="LM head: auto (default: int8 with quantized weights where it runs, else int4, else dense), dense, "
             "int8 (8-bit codes per group of 32, a GGUF's Q8_0 blocks as stored, int8 activations, the top 64 "
             "candidates rescored with the dense head: as accurate as llama.cpp's head) or int4 (int4 scores, the "
             "top 64 rescored: faster, a less accurate tail)")
    max_num_seqs: int = setting(8, min=1, commands=("serve",),
                                help="requests run at once (kvcore serve: default 16; the Python API: {default})")
    max_model_len: int | None = setting(
        None, min=2, help="context limit per request, in tokens (default: the model's window, at most 4096)")
    #: unchunked, a lone prompt may exceed it
    max_num_batched_tokens: int = setting(
        8192, min=1, commands=("serve",),
        help="tokens one forward may compute: decodes first, then prompt chunks (default {default})")
    #: vLLM's default: a long prompt then no longer stalls every running stream for its whole prefill
    enable_chunked_prefill: bool = setting(
        True, flag=False, help="split long prompts into chunks that share steps with the running decodes")
    block_size: int = setting(16, min=1, flag=False, help="paged caches: tokens per block")
    num_blocks: int | None = setting(
        None, min=1, commands=("serve",),
        help="KV-cache blocks (paged caches; default: from kv_cache_bytes, else max_num_seqs × max_model_len)")
    kv_cache_bytes: int | None = setting(None, min=1, commands=("serve",),
                                         help="size the paged KV cache to this budget")
    enable_prefix_caching: bool = setting(False, commands=("serve",), help="reuse shared prompt blocks")
    #: kvcore/scheduling/kv_groups.py
    free_window_blocks: bool = setting(
        True, flag=False, help="sliding-window layers give the KV blocks no later query reads back to the pool "
                               "(paged caches); off: every layer keeps every token's K/V")
    tensor_parallel_size: int = setting(
        1, min=1, metavar="N", help="split the model over N processes (gloo on CPU, NCCL on CUDA; default {default})")
    #: kvcore/execution/backend_check.py
    check_backend_outputs: bool = setting(
        True, flag=False, help="check every attention output (shape, dtype, finiteness; layer 0 against a "
                               "reference now and then) and fail the batch with BackendOutputError when one breaks")
    backend_check_interval: int = setting(
        256, min=1, flag=False, help="with check_backend_outputs: forwards of a backend between comparisons of "
                                     "layer 0 of one sequence against float32 attention")
    #: kvcore/execution/compile.py; needs a compilable decode backend
    compile: bool = setting(
        False, help="run decode steps through torch.compile (the first decode step compiles for tens of seconds; "
                    "needs a C++ compiler on CPU; slower than the eager default on the CPUs measured)")
    #: docs/speculative.md; verified in one forward
    proposer: str | None = setting(None, flag="--speculative", metavar="PROPOSER",
                                   help="speculative decoding with this proposer: ngram, draft (docs/speculative.md)")
    #: K: benchmarks/studies/verify_cost.py prices each draft row (docs/speculative.md)
    num_speculative_tokens: int = setting(
        8, min=1, metavar="K", help="draft tokens verified per step and request (default {default})")
    #: applied in order, each bound per layer (docs/attention-variants.md); backends that do not serve them are refused
    attention_variants: tuple[str, ...] = setting(
        (), flag="--attention-variant", metavar="NAME",
        help="attend with this registered attention variant (see `kvcore plugins`); repeatable")
    backend_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="backends", flag=False, help="keyword arguments of that backend's constructor")
    kv_cache_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="kv_caches", flag=False, help="keyword arguments of that KV cache's constructor")
    sampler_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="samplers", flag=False, help="keyword arguments of that sampler's constructor")
    proposer_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="proposers", flag=False, help="keyword arguments of that proposer's constructor")
    variant_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="variants", flag=False,
        help="keyword arguments of that attention variant's constructor")


@dataclass
class RunFields:
    """The settings of a run that are neither the engine's nor a request's (:class:`~kvcore.engine.settings.Settings`
    holds their values)."""

    model: str | None = setting(None, help="'smollm2' (default), a .gguf file or a Hugging Face directory")
    threads: int | None = setting(
        None, metavar="N", help="CPU threads for torch (default: the cores not busy with other work, at least 1)")
    plugin_options: dict[str, dict[str, Any]] = setting(
        default_factory=dict, table="plugins", flag=False, help="handed to that plugin's kvcore_configure hook")


#: the dataclasses whose declared fields are the run's settings, by the group of command-line flags they form:
#: ``run`` and ``engine`` flags go on every command that starts an engine, ``sampling`` on generate and chat
SETTINGS: dict[str, type] = {"engine": EngineFields, "sampling": SamplingParams, "run": RunFields}

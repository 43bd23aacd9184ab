"""The decoder's layers as two kvcore operators each (``csrc/fused_layer.cpp``), for ``int4a8`` models in bfloat16 or
float32.

At a decode step's few rows a layer's eager ops (norms, RoPE's products and sums, slices, the gate's activation
and product) cost a Python and ATen dispatch each, together more than the int4a8 matmuls they sit between.
``torch.ops.kvcore.fused_qkv`` runs the residual add, the input norm, the Q/K/V matmul and RoPE; the backend's
attention follows as in the eager path; ``torch.ops.kvcore.fused_mlp`` runs the output projection, the residual
add, the second norm, the gated MLP. Every value is rounded where the eager ops round it, by the same functions,
so the hidden states are the eager path's bit for bit, in bfloat16 and in float32 (tests/kernels/test_fused_layer.py).

A call whose attention the backend can describe as data (a :class:`~kvcore.interfaces.decode_stack.DecodeStack`:
``cpu_decode``'s decode batches and short rows after a cache) goes further: layer 0 runs as above, its attention
through the backend (so the backend check still observes and verifies it), and layers 1.. run as one operator,
``torch.ops.kvcore.decode_stack`` (``csrc/decode_stack.cpp``): the same functions in the same order with the
backend's cache writes and ``cached_decode_attention`` kernel between them, bit for bit the per-layer path
(tests/kernels/test_decode_stack.py), with no Python, dispatch or allocation per layer.

:func:`fused_layer_reasons` says where this runs: the layers the two operators spell out and nothing else (no
biases, no Q/K norms, no sandwich norms, SiLU gates, one rank), every matmul on the int4a8 kernel.
"""

from __future__ import annotations

import torch

from kvcore.interfaces.decode_stack import DecodeStack
from kvcore.kernels.quant import Int4A8Linear
from kvcore.model.layers import add_rms_norm

__all__ = ["fused_layer_reasons", "fused_forward"]


def fused_layer_reasons(model) -> list[str]:
    """Why ``model``'s layers cannot run on the fused operators ([] = they can)."""
    c = model.config
    reasons = []
    if not model.fused_norm or model.dtype not in (torch.bfloat16, torch.float32) or model.device.type != "cpu":
        reasons.append("the fused layers run int4a8 weights with bfloat16 or float32 activations on CPU")
    matmuls = model._quantized or {}
    if not matmuls or not all(isinstance(f, Int4A8Linear) for fns in matmuls.values() for f in fns):
        reasons.append("every layer matmul must run on the int4a8 kernel")
    options = {"Q/K/V biases": model.qkv_bias, "Q/K norms": model.q_norm, "an output bias": model.o_bias,
               "sandwich norms": model.post_attn_norm}
    reasons += [f"the fused layers have no {name}" for name, value in options.items() if value is not None]
    if c.hidden_act != "silu":
        reasons.append(f"the fused layers gate with SiLU, not {c.hidden_act}")
    if "all_reduce" in vars(model):  # tensor parallel: each rank's partial outputs are summed between the ops
        reasons.append("the fused layers run on one rank")
    return reasons


def fused_forward(model, h: torch.Tensor, tables: list, attention, matmuls: dict,
                  stack: DecodeStack | None = None) -> torch.Tensor:
    """The decoder's layers and final norm over the embeddings ``h [T, d]`` (updated in place, as in
    :meth:`DecoderModel.forward`): ``tables`` each layer's RoPE ``(cos, sin)``, ``matmuls`` the model's int4a8
    weights. With ``stack``, layer 0 runs as below (its attention through ``attention``, which a backend check
    observes) and the others as one ``torch.ops.kvcore.decode_stack`` call. Returns ``[T, d]`` final hidden states."""
    c = model.config
    num_tokens, eps, head_dim = h.shape[0], c.rms_norm_eps, c.head_dim
    heads = [c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads]
    num_rotated, num_heads = heads[0] + heads[1], sum(heads)
    fused_qkv, fused_mlp = torch.ops.kvcore.fused_qkv, torch.ops.kvcore.fused_mlp
    weights = _layer_weights(model, matmuls)
    input_norms, post_norms = weights[:2]
    num_python = 1 if stack is not None else c.num_hidden_layers
    pending = None  # the last MLP output, added to h by the next layer's first operator
    for i in range(num_python):
        (cos, sin), (qkv_w, qkv_dm, o_w, o_dm, gate_up_w, gate_up_dm, down_w, down_dm) = tables[i], _at(weights, i)
        # (T, (H + 2 H_kv) D), Q and K rotated
        qkv = fused_qkv(h, pending, input_norms[i], eps, qkv_w, qkv_dm, cos, sin, num_rotated)
        q, k, v = qkv.view(num_tokens, num_heads, head_dim).split_with_sizes(heads, 1)  # (T, H | H_kv | H_kv, D) views
        attn = attention(i, q, k, v)  # (T, H, D)
        pending = fused_mlp(h, attn, o_w, o_dm, post_norms[i], eps, gate_up_w, gate_up_dm, down_w, down_dm)
    if num_python < c.num_hidden_layers:
        cos, sin = zip(*tables)
        pending = torch.ops.kvcore.decode_stack(h, pending, num_python, *weights[:2], eps, *weights[2:], cos, sin,
                                                heads[0], *stack.op_args())
    return add_rms_norm(h, pending, model.norm, eps, fused=True)


def _layer_weights(model, matmuls: dict) -> tuple[list[torch.Tensor], ...]:
    """``(input_norms, post_norms, qkv codes, qkv dm, o codes, o dm, gate_up codes, gate_up dm, down codes,
    down dm)``: each a list over the layers the config runs (a layer-truncated copy's first ones), in decode_stack's
    argument order; made once per set of matmuls and layer count."""
    cached, n = model.__dict__.get("_fused_weights"), model.config.num_hidden_layers
    if cached is None or cached[0] is not matmuls or len(cached[1][0]) != n or torch.compiler.is_compiling():
        parts = [matmuls[name][:n] for name in ("qkv", "o", "gate_up", "down")]
        lists = (_tensors(model.input_norm)[:n], _tensors(model.post_norm)[:n],
                 *([attr(w) for w in fns] for fns in parts for attr in (lambda w: w.codes, lambda w: w.dm)))
        if torch.compiler.is_compiling():
            return lists
        cached = model.__dict__["_fused_weights"] = (matmuls, lists)
    return cached[1]


def _at(weights: tuple[list[torch.Tensor], ...], i: int) -> tuple[torch.Tensor, ...]:
    """Layer ``i``'s matmul weights, from :func:`_layer_weights`."""
    return tuple(w[i] for w in weights[2:])


def _tensors(params: torch.nn.ParameterList) -> list[torch.Tensor]:
    """The parameters of a ParameterList in order. Eagerly read from its own dict at once: indexing it costs a few
    Python calls per layer, more than a decode step's small kernels between them."""
    if torch.compiler.is_compiling():
        return [params[i] for i in range(len(params))]
    return list(params._parameters.values())

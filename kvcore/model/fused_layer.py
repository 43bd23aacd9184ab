"""The decoder's layers as two kvcore operators each (``csrc/fused_layer.cpp``), for bfloat16 ``int4a8`` models.

At a decode step's few rows a layer's eager ops (norms, RoPE's products and sums, slices, the gate's activation
and product) cost a Python and ATen dispatch each, together more than the int4a8 matmuls they sit between.
``torch.ops.kvcore.fused_qkv`` runs the residual add, the input norm, the Q/K/V matmul and RoPE; the backend's
attention follows as in the eager path; ``torch.ops.kvcore.fused_mlp`` runs the output projection, the residual
add, the second norm, the gated MLP. Every value is rounded where the eager ops round it, by the same functions,
so the hidden states are the eager path's bit for bit (tests/test_fused_layer.py).

:func:`fused_layer_reasons` says where this runs: the layers the two operators spell out and nothing else (no
biases, no Q/K norms, no sandwich norms, SiLU gates, one rank), every matmul on the int4a8 kernel.
"""

from __future__ import annotations

import torch

from kvcore.kernels.quant import Int4A8Linear
from kvcore.model.layers import add_rms_norm

__all__ = ["fused_layer_reasons", "fused_forward"]


def fused_layer_reasons(model) -> list[str]:
    """Why ``model``'s layers cannot run on the fused operators ([] = they can)."""
    c = model.config
    reasons = []
    if not model.fused_norm or model.dtype != torch.bfloat16 or model.device.type != "cpu":
        reasons.append("the fused layers run int4a8 weights with bfloat16 activations on CPU")
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


def fused_forward(model, h: torch.Tensor, tables: list, attention, matmuls: dict) -> torch.Tensor:
    """The decoder's layers and final norm over the embeddings ``h [T, d]`` (updated in place, as in
    :meth:`DecoderModel.forward`): ``tables`` each layer's RoPE ``(cos, sin)``, ``matmuls`` the model's int4a8
    weights. Returns ``[T, d]`` final hidden states."""
    c = model.config
    num_tokens, eps, head_dim = h.shape[0], c.rms_norm_eps, c.head_dim
    heads = [c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads]
    num_rotated, num_heads = heads[0] + heads[1], sum(heads)
    fused_qkv, fused_mlp = torch.ops.kvcore.fused_qkv, torch.ops.kvcore.fused_mlp
    layers = zip(_tensors(model.input_norm), _tensors(model.post_norm), tables, matmuls["qkv"], matmuls["o"],
                 matmuls["gate_up"], matmuls["down"])
    pending = None  # the last MLP output, added to h by the next layer's first operator
    for i, (input_norm, post_norm, (cos, sin), qkv_w, o_w, gate_up_w, down_w) in enumerate(layers):
        # (T, (H + 2 H_kv) D), Q and K rotated
        qkv = fused_qkv(h, pending, input_norm, eps, qkv_w.codes, qkv_w.dm, cos, sin, num_rotated)
        q, k, v = qkv.view(num_tokens, num_heads, head_dim).split_with_sizes(heads, 1)  # (T, H | H_kv | H_kv, D) views
        attn = attention(i, q, k, v)  # (T, H, D)
        pending = fused_mlp(h, attn, o_w.codes, o_w.dm, post_norm, eps, gate_up_w.codes, gate_up_w.dm, down_w.codes,
                            down_w.dm)
    return add_rms_norm(h, pending, model.norm, eps, fused=True)


def _tensors(params: torch.nn.ParameterList) -> list[torch.Tensor]:
    """The parameters of a ParameterList in order. Eagerly read from its own dict at once: indexing it costs a few
    Python calls per layer, more than a decode step's small kernels between them."""
    if torch.compiler.is_compiling():
        return [params[i] for i in range(len(params))]
    return list(params._parameters.values())

"""The one decoder kvcore runs (RMSNorm, RoPE, GQA, gated MLP), calling a pluggable attention backend.

Every supported family (see :mod:`kvcore.model.architectures`) is this decoder with options from its
:class:`~kvcore.model.config.ModelConfig`: Q/K/V biases (Qwen2), per-head Q/K RMSNorm (Qwen3), RMSNorm
weight offset (Gemma), scaled embeddings, sandwich norms and final-logit soft-capping (Gemma 2), GeLU-tanh
or SiLU gates, RoPE scaling schemes, a second RoPE base on sliding-window layers (Gemma 3). Sliding windows
and attention-logit soft-capping are attention variants: the model declares each layer's
(:attr:`DecoderModel.attention_layers`) and the engine picks backends that serve them.

Tensors are packed: a forward call carries ``T`` tokens from ``B`` sequences (see
:class:`~kvcore.interfaces.metadata.AttentionMetadata`). Q/K/V and gate/up projections are fused into one matmul each.
The model knows nothing of caches or backends: it calls the ``attention`` it is handed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.errors import ConfigError
from kvcore.interfaces.decode_stack import DecodeStack
from kvcore.interfaces.dtypes import dtype_name
from kvcore.kernels.linear import DenseMatmuls, set_layout
from kvcore.kernels.quant import quantized_reasons
from kvcore.model.config import ModelConfig
from kvcore.model.embedding import BlockTable, dense_embedding, hold_blocks
from kvcore.model.fused_layer import fused_forward, fused_layer_reasons
from kvcore.model.layers import ACTIVATIONS, add_rms_norm, attention_layers, rms_norm
from kvcore.model.rope import RotaryEmbedding
from kvcore.model.weights import LINEAR_PARTS, WeightCopier, copy_weights, quantized_linears

__all__ = ["DecoderModel", "LlamaModel", "RotaryEmbedding", "rms_norm", "Attention"]

#: ``attention(layer_idx, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> [T, H, D]``: stores this call's
#: K/V and attends (a backend bound to its cache and plan by the model runner)
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderModel(nn.Module):
    """Decoder weights plus the forward pass. Build it with :meth:`from_weights`.

    :param max_positions: the longest sequence this instance serves (RoPE table length); None: the
        config's ``max_position_embeddings``. ``model.config.max_position_embeddings`` reports it, so an
        engine never schedules past the tables; ``model.context_window`` keeps the config's.
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None
    ) -> None:
        super().__init__()
        c = config
        max_positions = min(max_positions or c.max_position_embeddings, c.max_position_embeddings)
        self.attention_layers = attention_layers(c, max_positions)
        self.config = dataclasses.replace(c, max_position_embeddings=max_positions)
        #: the model's own context window (tokens), which ``config`` reports no further than ``max_positions``
        self.context_window = c.max_position_embeddings
        L, d = c.num_hidden_layers, c.hidden_size
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_size, self.kv_size = q_size, kv_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        def per_layer(*shape: int) -> nn.ParameterList:
            return nn.ParameterList(empty(*shape) for _ in range(L))

        self.embed_tokens = empty(c.vocab_size, d)  # [V, d]
        self.embedding: BlockTable | None = None  # the table as GGUF blocks (embed_tokens then empty)
        #: files whose mapped pages are weights of this model (kvcore.loaders.watched.WatchedFile), set by the loader
        self.mapped_files: list = []
        self.input_norm = per_layer(d)
        self.qkv_proj = per_layer(q_size + 2 * kv_size, d)  # [(H + 2 H_kv) D, d]
        self.qkv_bias = per_layer(q_size + 2 * kv_size) if c.attention_bias else None
        self.q_norm = per_layer(c.head_dim) if c.qk_norm else None
        self.k_norm = per_layer(c.head_dim) if c.qk_norm else None
        self.o_proj = per_layer(d, q_size)
        self.o_bias = per_layer(d) if c.attention_output_bias else None
        self.post_attn_norm = per_layer(d) if c.sandwich_norms else None
        self.post_norm = per_layer(d)  # the norm before the MLP
        self.gate_up_proj = per_layer(2 * c.intermediate_size, d)  # [2 I, d]
        self.down_proj = per_layer(d, c.intermediate_size)
        self.post_mlp_norm = per_layer(d) if c.sandwich_norms else None
        self.norm = empty(d)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else empty(c.vocab_size, d)
        self.rotary = RotaryEmbedding(
            c.head_dim, max_positions, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        #: Gemma 3: sliding-window layers rotate with their own base and no scaling
        self.rotary_local = None if c.rope_local_base_freq is None else RotaryEmbedding(
            c.head_dim, max_positions, c.rope_local_base_freq, None, c.max_position_embeddings
        )
        self.act = ACTIVATIONS[c.hidden_act]
        #: "float", or "int4"/"int4a8"/"int8" when the layer matmuls run on quantized weights (kernels.quant)
        self.weight_format = "float"
        self._quantized: dict[str, list] | None = None  # {"qkv"|"o"|"gate_up"|"down": [per layer]}
        #: the int4a8 copy of the LM head its int4 head scores with (kvcore.model.lm_head), once made: kept with the
        #: model, so that a prepared model (kvcore.loaders.prepared) holds it too
        self.head_int4 = None
        #: the int8-group copy of the LM head its int8 head scores with, once made (kept with the model likewise)
        self.head_int8 = None
        self._dense = DenseMatmuls()
        self._set_weight_layout(values=False)  # the parameters are written after

    def _apply(self, fn, recurse=True):  # .to() / .float() / .cuda() ... : re-pick the weight layout
        if self._quantized is not None:  # probe where fn sends a tensor before moving anything
            probe = fn(self.embed_tokens[:0])
            why = quantized_reasons(self.weight_format, probe.dtype, probe.device)
            if why:
                raise ConfigError(f"cannot move this model to {probe.device.type} {dtype_name(probe.dtype)}: "
                                  f"{'; '.join(why)}")
        super()._apply(fn, recurse)
        self._set_weight_layout()
        return self

    def _set_weight_layout(self, values: bool = True) -> None:
        """Store each matmul weight (logical shape ``[out, in]``) in the order its device and dtype read fastest:
        column-major on CPU in float32 (``F.linear`` then runs MKL's ``x @ Wt`` kernel, faster for few-row
        decode GEMMs), row-major elsewhere (bfloat16 CPU GEMMs are slow column-major) and for small weights."""
        column_major = self.device.type == "cpu" and self.dtype == torch.float32
        self._dense.reset()
        with torch.no_grad():
            for plist in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
                for p in plist:
                    set_layout(p, column_major, values)
            set_layout(self.lm_head, column_major, values)  # tied embeddings: the embedding table too

    #: Dense bfloat16 matmuls on CPU run on copies of the big weights in a faster layout (kvcore's bf16_linear
    #: kernel's, or oneDNN's prepacked one); float32 keeps one copy. See :class:`DenseMatmuls`.
    #: Set False (on an instance or the class) to keep a single copy of the weights.
    packed_weights: bool = True
    #: residual adds and RMSNorms on kvcore's fused kernel (:func:`~kvcore.model.layers.add_rms_norm`): set for
    #: int4a8 models, which load the kernels and are approximate already; dense models keep the eager ops
    fused_norm: bool = False
    #: each layer as kvcore's two fused operators (:mod:`kvcore.model.fused_layer`): set where they compute what the
    #: eager ops do (bfloat16 int4a8 Llama-style layers), since their dispatch costs more than a decode step's matmuls
    fused_layers: bool = False

    def matmuls(self, num_rows: int) -> dict[str, list]:
        """``{"qkv", "o", "gate_up", "down": [per layer]}`` callables ``x -> x @ W.T`` for a forward of ``num_rows``
        rows: quantized ones (when the model has them) or dense ones, then with ``"lm_head": [one]`` too."""
        if self._quantized is None:
            lists = {"qkv": self.qkv_proj, "o": self.o_proj, "gate_up": self.gate_up_proj, "down": self.down_proj}
            return self._dense.get({**lists, "lm_head": [self.lm_head]}, num_rows, self.packed_weights)
        return self._quantized

    def dense_head(self, num_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The dense LM head's callable for ``num_rows`` rows. A quantized model builds it only when logits need it:
        where its int4 head scores every decode step, no packed copy of the head is ever made."""
        if self._quantized is None:
            return self.matmuls(num_rows)["lm_head"][0]
        dense_embedding(self)
        return self._dense.get({"lm_head": [self.lm_head]}, num_rows, self.packed_weights)["lm_head"][0]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        weight_format: str = "float",
        group_size: int = 32,
    ) -> DecoderModel:
        """Build from kvcore's canonical weight names (:func:`kvcore.loaders.expected_shapes`: Hugging Face
        Llama's, ``model.layers.0.self_attn.q_proj.weight``..., plus the optional biases and norms). Values are
        float tensors or GGUF blocks (:mod:`kvcore.loaders.gguf_blocks`). ``weight_format`` "int4"/"int4a8"/"int8"
        (resolved: see :func:`kvcore.model.weights.resolve_weights`) runs the layer matmuls on quantized weights
        (int4 groups of ``group_size`` input columns where the weights are not GGUF Q4 blocks already)."""
        model = cls(config, dtype, max_positions)
        c = config
        if weight_format != "float":
            model._quantized = quantized_linears(c, weights, weight_format, dtype, group_size)
            model.weight_format = weight_format
            model.fused_norm = weight_format == "int4a8"
            model.fused_layers = not fused_layer_reasons(model)
            linear_names = {f"model.layers.{i}.{p}" for i in range(c.num_hidden_layers) for ps in
                            LINEAR_PARTS.values() for p in ps}
            weights = {n: v for n, v in weights.items() if n not in linear_names}
            for plist in (model.qkv_proj, model.o_proj, model.gate_up_proj, model.down_proj):
                for i in range(c.num_hidden_layers):  # no dense copy: the quantized weights are the model's
                    plist[i] = nn.Parameter(torch.empty(0, c.hidden_size, dtype=dtype), requires_grad=False)
            weights = hold_blocks(model, weights, dtype)

        copy_weights(model, WeightCopier(weights, c, dtype).put)
        return model

    #: ``all_reduce(partial [T, d]) -> [T, d]``, applied to the o_proj and down_proj outputs: under tensor
    #: parallelism (kvcore/execution/distributed/sharding.py) it sums each rank's partial output; identity otherwise
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda partial: partial)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every attention layer: ``1 / sqrt(head_dim)``, or Gemma 2's
        ``1 / sqrt(query_pre_attn_scalar)``."""
        c = self.config
        return (c.query_pre_attn_scalar or c.head_dim) ** -0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention, matmuls: dict | None = None,
        stack: DecodeStack | None = None,
    ) -> torch.Tensor:
        """Run the decoder over packed tokens.

        :param input_ids: ``[T]`` int64 token ids.
        :param positions: ``[T]`` int64 absolute position of each token (RoPE), below
            ``config.max_position_embeddings``.
        :param attention: stores each layer's K/V and attends (see :data:`Attention`).
        :param matmuls: ``self.matmuls(T)``, when the caller already has it (a compiled forward resolves it
            outside the traced code: choosing and caching the kernels is Python bookkeeping).
        :param stack: the backend's attention of every layer as data, for fused layers to run layers 1.. as one
            native call (:func:`~kvcore.model.fused_layer.fused_forward`); ignored by the other paths.
        :returns: ``[T, d]`` final hidden states (after the last RMSNorm).
        """
        c = self.config
        num_tokens = input_ids.shape[0]
        eps = c.rms_norm_eps
        num_heads, num_kv, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qk_size = self.q_size + self.kv_size
        tables = [self.rotary.tables(positions, self.dtype)] * c.num_hidden_layers  # once per call, shared
        if self.rotary_local is not None:
            local = self.rotary_local.tables(positions, self.dtype)
            tables = [local if c.layer_window(i) is not None else t for i, t in enumerate(tables)]
        mm = matmuls or self.matmuls(num_tokens)
        qkv_w, o_w, gate_up_w, down_w = mm["qkv"], mm["o"], mm["gate_up"], mm["down"]  # x [T, in] -> [T, out]
        h = F.embedding(input_ids, self.embed_tokens) if self.embedding is None else self.embedding(input_ids)  # (T, d)
        if c.embedding_multiplier is not None:
            h = h * torch.tensor(c.embedding_multiplier, dtype=h.dtype)  # Gemma rounds the factor to the dtype
        if self.fused_layers and mm is self._quantized:
            return fused_forward(self, h, tables, attention, mm, stack)
        fused, pending = self.fused_norm, None  # pending: the last MLP output, added to h by the next norm
        for i in range(c.num_hidden_layers):
            cos, sin = tables[i]
            x = add_rms_norm(h, pending, self.input_norm[i], eps, fused)
            qkv = qkv_w[i](x)  # (T, (H + 2 H_kv) D)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias[i]
            if self.q_norm is None:
                # Q and K are adjacent in the fused projection: one RoPE over H + H_kv heads.
                qk = qkv[:, :qk_size].view(num_tokens, num_heads + num_kv, head_dim)
                qk = self.rotary.rotate(qk, cos, sin)
                q, k = qk[:, :num_heads], qk[:, num_heads:]  # (T, H, D), (T, H_kv, D) views
            else:  # Qwen3, Gemma 3: each head's Q and K RMS-normalised before RoPE
                q = rms_norm(qkv[:, : self.q_size].reshape(num_tokens, num_heads, head_dim), self.q_norm[i], eps)
                k = rms_norm(qkv[:, self.q_size : qk_size].reshape(num_tokens, num_kv, head_dim), self.k_norm[i], eps)
                q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
            v = qkv[:, qk_size:].view(num_tokens, num_kv, head_dim)  # (T, H_kv, D)
            attn = attention(i, q, k, v)  # (T, H, D)
            # all_reduce sums the ranks' partial outputs under tensor parallelism (identity otherwise); a bias
            # or norm applies once, to the sum
            out = self.all_reduce(o_w[i](attn.reshape(num_tokens, self.q_size)))
            if self.o_bias is not None:
                out = out + self.o_bias[i]
            if self.post_attn_norm is not None:
                out = rms_norm(out, self.post_attn_norm[i], eps)
            # h is this forward's own tensor: residual adds and the gate product run in place, which saves
            # the prefill a fresh multi-megabyte allocation (page faults) per op; the values are the same.
            x = add_rms_norm(h, out, self.post_norm[i], eps, fused)
            gate, up = gate_up_w[i](x).chunk(2, dim=-1)  # (T, I) each
            out = self.all_reduce(down_w[i](self.act(gate).mul_(up)))
            if self.post_mlp_norm is not None:
                out = rms_norm(out, self.post_mlp_norm[i], eps)
            pending = out
        return add_rms_norm(h, pending, self.norm, eps, fused)

    def compute_logits(self, hidden: torch.Tensor, head: Callable | None = None) -> torch.Tensor:
        """``[N, d]`` hidden states → ``[N, V]`` float32 logits (soft-capped when the config says so).

        :param head: another form of the LM head (:class:`kvcore.model.lm_head.RescoredInt4Head`), used for batches
            of at most ``head.max_rows`` rows; the dense head otherwise."""
        cap = self.config.final_logit_softcapping
        if head is not None and hidden.shape[0] <= head.max_rows:
            logits = head(hidden, widen=cap is None)  # float32 from the head's kernel unless a soft-cap follows
        else:
            logits = self.dense_head(hidden.shape[0])(hidden)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


#: the historical name: every family runs on the same decoder
LlamaModel = DecoderModel

"""Test helpers importable from any test module (``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

from kvcore import LlamaModel, ModelConfig, SamplingParams, hookimpl
from kvcore.cli.parser import build_parser
from kvcore.plugins.registry import PluginRegistry


def make_random_model(
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    vocab_size: int = 300,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie: bool = False,
    max_positions: int = 512,
) -> LlamaModel:
    hidden = num_heads * head_dim
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        eos_token_id=2,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg, torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.to(dtype) if dtype != torch.float32 else model


def make_random_gemma3(
    *, num_layers: int = 6, window: int = 7, num_kv_heads: int = 2, seed: int = 0, max_positions: int = 512
) -> LlamaModel:
    """A random Gemma 3 text model: five sliding-window layers to one global (every sixth), local and global
    RoPE bases, QK-norm, sandwich norms."""
    cfg = ModelConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16, max_position_embeddings=max_positions,
        eos_token_id=2, architecture="gemma3", qk_norm=True, norm_offset=1.0, sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=window, rope_local_base_freq=1e4,
        sliding_window_layers=tuple(i for i in range(num_layers) if (i + 1) % 6), tie_word_embeddings=True,
        embedding_multiplier=8.0,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg, torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))
    return model


def make_plugin(
    *,
    backends: Iterable[type] = (),
    kv_caches: Iterable[type] = (),
    samplers: Iterable[type] = (),
    architectures: Iterable[type] = (),
    proposers: Iterable[type] = (),
    variants: Iterable[type] = (),
    raises: Exception | None = None,
    raise_in: str = "kvcore_register_backends",
) -> types.ModuleType:
    """A throwaway plugin module registering the given classes through the ``kvcore_register_*`` hooks;
    with ``raises``, the hook named ``raise_in`` raises it instead of registering."""
    module = types.ModuleType("throwaway_plugin")
    for hook, classes in (
        ("kvcore_register_backends", tuple(backends)),
        ("kvcore_register_kv_caches", tuple(kv_caches)),
        ("kvcore_register_samplers", tuple(samplers)),
        ("kvcore_register_architectures", tuple(architectures)),
        ("kvcore_register_proposers", tuple(proposers)),
        ("kvcore_register_attention_variants", tuple(variants)),
    ):

        def impl(register, _classes=classes, _hook=hook):
            if raises is not None and _hook == raise_in:
                raise raises
            for cls in _classes:
                register(cls)

        impl.__name__ = hook
        setattr(module, hook, hookimpl(impl))
    return module


@contextlib.contextmanager
def registered(registry: PluginRegistry, plugin: object, name: str) -> Iterator[PluginRegistry]:
    """``plugin`` registered in ``registry`` as ``name`` for the block, always unregistered after
    (datasette style)."""
    registry.register_plugin(plugin, name=name)
    try:
        yield registry
    finally:
        registry.unregister_plugin(name)


def subcommands() -> dict:
    """The ``kvcore`` command line's subcommand parsers by name (plugin commands included)."""
    [sub] = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


def run_cli(capsys, *argv):
    """``kvcore *argv`` through :func:`kvcore.cli.main` in this process: (exit code, stdout, stderr)."""
    from kvcore.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def last_json(out: str) -> dict:
    """The ``--json`` result object: the last line of stdout."""
    return json.loads(out.strip().splitlines()[-1])


@dataclass
class Row:
    """A :class:`~kvcore.sampling.sampler.SamplingRow` built by hand."""

    params: SamplingParams
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    request_id: str = "r"


def full_attention(layer, q, k, v):
    """Causal attention over the whole call (one sequence, no cache): a model's plain reference pass."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1)


def weights_of(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The canonical weights of a random model (from_weights's input)."""
    c, state = model.config, {}
    state["model.embed_tokens.weight"], state["model.norm.weight"] = model.embed_tokens, model.norm
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v = model.qkv_proj[i].split([model.q_size, model.kv_size, model.kv_size])
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": model.o_proj[i],
                      p + "input_layernorm.weight": model.input_norm[i],
                      p + "post_attention_layernorm.weight": model.post_norm[i]})
        gate, up = model.gate_up_proj[i].chunk(2)
        state.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": model.down_proj[i]})
    return {n: t.detach() for n, t in state.items()}


class FastGGUFReader(gguf.GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map, for transformers' GGUF loading in tests.

    The reader slices its ``np.memmap`` once per metadata value, and every slice of a memmap subclass pays for
    ``__array_finalize__`` (seconds for a 49k-token vocabulary); a plain view of the same mapping reads the same
    bytes several times faster. The base class assigns ``self.data`` in ``__init__``; this property intercepts it.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)

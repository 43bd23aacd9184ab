"""Test helpers importable from any test module (``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kvcore import LlamaModel, ModelConfig, SamplingParams, hookimpl
from kvcore.plugins import PluginRegistry


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


def make_plugin(
    *,
    backends: Iterable[type] = (),
    kv_caches: Iterable[type] = (),
    samplers: Iterable[type] = (),
    architectures: Iterable[type] = (),
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
    """A :class:`~kvcore.sampling.SamplingRow` built by hand."""

    params: SamplingParams
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    request_id: str = "r"

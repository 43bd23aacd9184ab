"""Fixtures shared by the example package's tests."""

from __future__ import annotations

import kvcore_example_variant.plugin
import pytest
import torch

from kvcore import LlamaModel, ModelConfig
from kvcore.plugins.registry import PluginRegistry


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny tensors: one intra-op thread beats two on a busy small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def registry() -> PluginRegistry:
    """kvcore's built-ins plus this package's plugin module, registered the way its entry point would be."""
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(kvcore_example_variant.plugin, name="example_variants")
    return reg


def random_model(*, num_layers: int = 2, seed: int = 0, **config) -> LlamaModel:
    """A small Llama with random weights (float32, cpu); ``config``: further ModelConfig fields."""
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_id=2, **config)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(config, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 else 1.0 + 0.1 * torch.randn(p.shape))
    return model

"""Fixtures shared by the example package's tests."""

from __future__ import annotations

import kvcore_example_backend.plugin
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
    """kvcore's built-ins plus this package's plugin module, registered the way its entry point would be;
    a registry of its own, so no test depends on which entry points the environment loads."""
    reg = PluginRegistry(load_entrypoints=False)
    reg.register_plugin(kvcore_example_backend.plugin, name="example_chunked")
    return reg


def _random_model(
    *, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, vocab_size=128, seed=0, eos_token_id=2
) -> LlamaModel:
    hidden = num_heads * head_dim
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        eos_token_id=eos_token_id,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(config, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture
def make_model():
    """``make_model(**sizes)``: a small Llama with random weights (float32, cpu)."""
    return _random_model

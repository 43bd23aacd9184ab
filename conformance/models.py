"""Models for the model-level tiers, built or loaded once per process.

``tiny``
    A random-weights Llama built in memory from a fixed seed (no files): 2 layers, 4 query heads over
    2 KV heads (GQA), head_dim 32, vocab 512. Weights are scaled so attention scores are O(1) and
    logits have clear top-1 gaps; it runs a decode step in milliseconds.
``tiny-local``
    ``tiny`` with attention variants (the stream tier's variant dimension): layer 0 attends through an
    8-token sliding window, both layers soft-cap their scores at 10; its prompts (up to 33 tokens) and
    decodes run past the window.
``smollm2``
    The embedded SmolLM2-135M-Instruct (30 layers, 9 heads over 3 KV heads, head_dim 64).
anything else
    A ``.gguf`` file or Hugging Face model directory, loaded with :func:`kvcore.loaders.load_model`.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace

import torch

from kvcore.model.config import ModelConfig
from kvcore.model.decoder import LlamaModel

__all__ = ["ConformanceModel", "get_model", "model_problem", "TINY_CONFIG"]

TINY_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
)

#: ``tiny`` with a local layer and soft-capped scores (see the module docstring)
TINY_LOCAL_CONFIG = replace(TINY_CONFIG, sliding_window=8, sliding_window_layers=(0,), attn_logit_softcapping=10.0)

_SMOLLM2_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who "
    "repaired every clock in the valley. One winter morning,",
)


@dataclass
class ConformanceModel:
    name: str
    model: LlamaModel
    prompts: list[list[int]]  # token ids, ragged lengths

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def shape_kwargs(self) -> dict:
        c = self.config
        return {"head_dim": c.head_dim, "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads}

    def continuation(self, length: int, salt: str = "") -> list[int]:
        """Fixed pseudo-random token ids (teacher forcing in the cache tier)."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.name}{salt}".encode()))
        return torch.randint(3, self.config.vocab_size, (length,), generator=gen).tolist()


def _tiny_weights(c: ModelConfig = TINY_CONFIG) -> LlamaModel:
    gen = torch.Generator().manual_seed(1234)
    model = LlamaModel(c, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "embed_tokens":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head":
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / c.hidden_size**0.5))
            else:  # [out, in]: unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def _tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, TINY_CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 33)]


@functools.lru_cache(maxsize=4)
def _loaded(spec: str):
    from kvcore.loaders import load_model

    return load_model(spec)


@functools.lru_cache(maxsize=8)
def get_model(spec: str, dtype: torch.dtype, device: str) -> ConformanceModel:
    """The model ``spec`` in ``dtype`` on ``device``, cached per process. Raises :class:`KVCoreError`."""
    if spec in ("tiny", "tiny-local"):
        model = _tiny_weights(TINY_CONFIG if spec == "tiny" else TINY_LOCAL_CONFIG)
        model = model.to(dtype=dtype, device=device) if dtype != torch.float32 or device != "cpu" else model
        return ConformanceModel(spec, model, _tiny_prompts())
    loaded = _loaded(spec)
    model = LlamaModel.from_weights(loaded.config, loaded.weights, dtype).to(device)
    tok = loaded.tokenizer
    if spec.strip().lower() == "smollm2":
        prompts = [tok.encode(p) for p in _SMOLLM2_PROMPTS]
    else:
        gen = torch.Generator().manual_seed(7)
        vocab = loaded.config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 33)]
    return ConformanceModel(spec, model, prompts)


def model_problem(spec: str, dtype: torch.dtype, device: str) -> str | None:
    """Why ``spec`` cannot be loaded (``None`` when it can)."""
    try:
        get_model(spec, dtype, device)
    except Exception as exc:  # KVCoreError from the loaders; anything else from a broken file
        return f"model '{spec}' cannot be loaded: {exc}"
    return None

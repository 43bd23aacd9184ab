"""config.json of released checkpoints (as published, weights not needed) -> the decoder options kvcore
derives, each layer's attention, and what a model built from them refuses."""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import ModelLoadError
from kvcore.model.decoder import DecoderModel
from kvcore.plugins.architectures import for_hf_config

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192}

LLAMA31 = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
MISTRAL01 = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096,
             "max_position_embeddings": 32768}
QWEN25 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
          "sliding_window": 131072, "max_window_layers": 28, "tie_word_embeddings": True}
PHI3_MINI_4K = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 2047,
                "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_scaling": None}
GEMMA2 = {**BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16,
          "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16, "sliding_window": 4096,
          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}


def config_of(cfg: dict):
    return for_hf_config(cfg, "m").config_from_hf(cfg, None, "m")


def test_llama31():
    c = config_of(LLAMA31)
    assert c.architecture == "llama" and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.original_max_position_embeddings == 8192 and c.rope_theta == 500000.0
    model = DecoderModel(c, max_positions=4096)
    assert model.rotary.cos.shape[0] == 4096  # sized to the engine's reach, not 131072


def windows(model: DecoderModel) -> list[int | None]:
    return [a.sliding_window for a in model.attention_layers]


def test_mistral_window_declared_where_it_is_shorter_than_the_context():
    c = config_of(MISTRAL01)
    assert (c.sliding_window, c.sliding_window_layers) == (4096, None)
    assert windows(DecoderModel(c, max_positions=8192)) == [4096] * 4
    assert windows(DecoderModel(c, max_positions=4096)) == [None] * 4  # it hides nothing there


def test_qwen25_window_off_unless_use_sliding_window():
    c = config_of(QWEN25)
    assert c.attention_bias and not c.attention_output_bias and c.sliding_window is None and c.tie_word_embeddings
    c = config_of({**QWEN25, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2})
    assert (c.sliding_window, c.sliding_window_layers) == (32, (2, 3))


def test_phi3_mini_4k_window():
    c = config_of(PHI3_MINI_4K)
    assert c.sliding_window == 2047 and c.rope_scaling is None
    assert windows(DecoderModel(c, max_positions=4096)) == [2047] * 4


def test_gemma2_options_and_attention():
    c = config_of(GEMMA2)
    assert (c.norm_offset, c.sandwich_norms, c.hidden_act) == (1.0, True, "gelu_pytorch_tanh")
    assert c.embedding_multiplier == 8.0 and c.final_logit_softcapping == 30.0 and c.tie_word_embeddings
    assert (c.sliding_window, c.sliding_window_layers) == (4096, (0, 2))
    layers = DecoderModel(c, max_positions=8192).attention_layers
    assert windows(DecoderModel(c, max_positions=8192)) == [4096, None, 4096, None]
    assert {(a.softcap, a.scale) for a in layers} == {(50.0, 0.25)}


#: Gemma 3 1B's config.json as published (transformers 4.x keys), sizes shrunk
GEMMA3_1B = {**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16,
             "num_hidden_layers": 12, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
             "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
             "rope_scaling": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
             "max_position_embeddings": 32768}


@pytest.mark.parametrize("rope", [{}, {"rope_parameters": {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}], ids=["4.x", "5.x"])
def test_gemma3_local_global_layers(rope):
    c = config_of({**GEMMA3_1B, **rope})
    assert (c.qk_norm, c.sandwich_norms, c.norm_offset, c.rope_theta, c.rope_local_base_freq) == (
        True, True, 1.0, 1e6, 1e4)
    model = DecoderModel(c, max_positions=1024)
    assert windows(model) == [512] * 5 + [None] + [512] * 5 + [None]  # five local : one global
    assert {a.scale for a in model.attention_layers} == {256**-0.5}
    assert model.rotary_local is not None and not torch.equal(model.rotary_local.cos, model.rotary.cos)


@pytest.mark.parametrize("bad, message", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' needs original_max_position_embeddings"),
])
def test_refusals_name_what_is_unsupported(bad, message):
    with pytest.raises(ModelLoadError, match=message):
        config_of({**LLAMA31, "rope_scaling": None, **bad})

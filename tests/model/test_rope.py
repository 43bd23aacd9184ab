"""RoPE: every scaling scheme's inverse frequencies and attention factor equal transformers'
``ROPE_INIT_FUNCTIONS`` (the reference implementation), and the rotation equals transformers' rotary layer."""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import ModelLoadError
from kvcore.model.architectures import hf_rope_scaling
from kvcore.model.rope import RopeScaling, RotaryEmbedding, inv_freq_and_factor

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM, WINDOW = 64, 4096
CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                               "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 100,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.3 * i for i in range(HEAD_DIM // 2)]},
}


def _reference(params: dict, seq_len: int | None):
    rope = {"rope_theta": 50000.0, **params}
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=WINDOW,
        rope_parameters=rope,
    )
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config=config, device=None, seq_len=seq_len)
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, seq_len=seq_len)


@pytest.mark.parametrize("seq_len", [256, 2 * WINDOW], ids=["short", "long"])
@pytest.mark.parametrize("case", list(CASES))
def test_inverse_frequencies_match_transformers(case, seq_len):
    params = CASES[case]
    ref_inv, ref_factor = _reference(params, seq_len)
    scaling = hf_rope_scaling(params, {}, "test")
    inv, factor = inv_freq_and_factor(HEAD_DIM, 50000.0, scaling, WINDOW, seq_len)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert factor == pytest.approx(float(ref_factor), rel=1e-12)


@pytest.mark.parametrize("case", ["default", "llama3", "yarn", "longrope"])
def test_rotation_matches_transformers(case):
    """cos/sin tables (incl. the attention factor) and the rotate-half rotation, against transformers'
    LlamaRotaryEmbedding + apply_rotary_pos_emb, at positions inside the table."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = {"rope_theta": 50000.0, **CASES[case]}
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=WINDOW,
        rope_parameters=rope,
    )
    positions = torch.tensor([0, 1, 5, 100, 511, 1000])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    x = torch.randn(len(positions), 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(HEAD_DIM, 1024, 50000.0, hf_rope_scaling(rope, {}, "t"), WINDOW)
    torch.testing.assert_close(ours(x, positions), want[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_tables_cover_exactly_max_positions():
    rope = RotaryEmbedding(16, 48, 10000.0)
    assert rope.cos.shape == (48, 8) and rope.max_positions == 48


def test_incomplete_or_unknown_schemes_are_refused():
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling 'su2'"):
        RopeScaling("su2")
    with pytest.raises(ModelLoadError, match="'yarn' needs original_max_position_embeddings"):
        RopeScaling("yarn", factor=2.0)
    with pytest.raises(ModelLoadError, match="'longrope' needs short_factor and long_factor"):
        RopeScaling("longrope", original_max_position_embeddings=10)
    with pytest.raises(ModelLoadError, match="longrope factors have 3 entries, expected 8"):
        inv_freq_and_factor(16, 1e4, RopeScaling("longrope", original_max_position_embeddings=8,
                                                 short_factor=(1.0,) * 3, long_factor=(1.0,) * 3), 16, 16)

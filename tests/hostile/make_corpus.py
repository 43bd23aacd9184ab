"""A corpus of hostile model files: malformed or adversarial GGUF files, Hugging Face directories and chat
templates, each with what kvcore must do with it (a typed error, or load and run correctly).

``python tests/hostile/make_corpus.py DIR`` writes every case under ``DIR``; tests/e2e/test_hostile.py builds
the corpus in a temporary directory and runs each case under a memory and time limit
(tests/hostile/run_cases.py). Files are written byte by byte here (not with the ``gguf`` package's
writer), so every count, length, type and offset can be made to lie.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# -- the tiny model every case starts from ------------------------------------------------------------
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, CONTEXT = 40, 16, 2, 1, 8, 32, 2, 64
TOKENS = ["<unk>", "<s>", "</s>", "▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "▁a", "▁t", "th", "he", "▁th", "in", "er", "an", "on", "re"
]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
#: chat templates that attack the renderer (loops 10^10 times; builds a 1 GB string)
HANG_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EXPLODE_TEMPLATE = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}
GGML_F32, GGML_Q8_0 = 0, 8


def _str(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        return _str(value)
    if vtype == ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


@dataclass
class GGUFSpec:
    """Every field of a GGUF file, each free to lie: ``meta`` is ``[(key, type, value)]`` (raw bytes
    allowed for keys and strings), ``tensors`` ``[(name, dims in GGUF order, ggml type, data)]``."""

    meta: list[tuple[Any, int, Any]]
    tensors: list[tuple[str, tuple[int, ...], int, bytes]]
    magic: bytes = b"GGUF"
    version: int = 3
    num_tensors: int | None = None  # None: the true count
    num_kv: int | None = None
    alignment: int = 32
    offsets: list[int] | None = None  # None: packed, each aligned

    def encode(self) -> tuple[bytes, dict[str, int]]:
        """The file and where its sections start (``kv``, ``tensor_infos``, ``data``, ``end``)."""
        out = bytearray(self.magic + struct.pack("<I", self.version))
        out += struct.pack("<QQ", len(self.tensors) if self.num_tensors is None else self.num_tensors,
                           len(self.meta) if self.num_kv is None else self.num_kv)
        marks = {"kv": len(out)}
        for key, vtype, value in self.meta:
            out += _str(key) + struct.pack("<I", vtype) + _value(vtype, value)
        marks["tensor_infos"] = len(out)
        offsets, pos = [], 0
        for _, _, _, data in self.tensors:
            offsets.append(pos)
            pos += -(-len(data) // self.alignment) * self.alignment
        offsets = self.offsets or offsets
        for (name, dims, ggml_type, _), offset in zip(self.tensors, offsets):
            out += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}q", *dims)
            out += struct.pack("<IQ", ggml_type, offset)
        out += b"\0" * (-len(out) % self.alignment)
        marks["data"] = len(out)
        data = bytearray(pos)  # the packed size: a lying offset does not grow the file
        for offset, (*_, d) in zip(offsets, self.tensors):
            data[offset : offset + len(d)] = d[: max(pos - offset, 0)]
        out += data
        marks["end"] = len(out)
        return bytes(out), marks


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> float32 array in numpy order ([out, in]; GGUF dims are the reverse)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, shape).astype(np.float32)

    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": 1 + w(HIDDEN),
           "output.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": 1 + w(HIDDEN), p + "attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM), p + "ffn_norm.weight": 1 + w(HIDDEN),
            p + "ffn_gate.weight": w(INTER, HIDDEN), p + "ffn_up.weight": w(INTER, HIDDEN),
            p + "ffn_down.weight": w(HIDDEN, INTER),
        })
    return out


def _poisoned(value: float) -> dict[str, np.ndarray]:
    """The tiny weights with one value of layer 0's down projection replaced (NaN or inf)."""
    weights = tiny_weights()
    weights["blk.0.ffn_down.weight"][3, 5] = value
    return weights


def base_meta(template: str | bytes = TEMPLATE, **llama: tuple[int, Any]) -> list[tuple[Any, int, Any]]:
    """Metadata of the tiny llama model; ``llama`` overrides ``llama.*`` keys as ``key=(type, value)``
    (dots in keys written as ``__``)."""
    arch = {"block_count": (U32, LAYERS), "context_length": (U32, CONTEXT), "embedding_length": (U32, HIDDEN),
            "feed_forward_length": (U32, INTER), "attention.head_count": (U32, HEADS),
            "attention.head_count_kv": (U32, KV_HEADS), "attention.layer_norm_rms_epsilon": (F32, 1e-5),
            "rope.freq_base": (F32, 10000.0)}
    arch.update({k.replace("__", "."): v for k, v in llama.items()})
    meta: list[tuple[Any, int, Any]] = [("general.architecture", STR, "llama"), ("general.alignment", U32, 32)]
    meta += [(f"llama.{k}", t, v) for k, (t, v) in arch.items()]
    meta += [
        ("tokenizer.ggml.model", STR, "llama"),
        ("tokenizer.ggml.tokens", ARR, (STR, TOKENS)),
        ("tokenizer.ggml.scores", ARR, (F32, [-float(i) for i in range(VOCAB)])),
        ("tokenizer.ggml.token_type", ARR, (I32, [2, 3, 3] + [1] * (VOCAB - 3))),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.ggml.unknown_token_id", U32, 0),
        ("tokenizer.chat_template", STR, template),
    ]
    return meta


def base_tensors(weights: dict[str, np.ndarray] | None = None) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    weights = weights or tiny_weights()
    return [(n, tuple(reversed(a.shape)), GGML_F32, a.tobytes()) for n, a in weights.items()]


def base_spec(**changes: Any) -> GGUFSpec:
    spec = GGUFSpec(base_meta(), base_tensors())
    for name, value in changes.items():
        setattr(spec, name, value)
    return spec


def _set_meta(spec: GGUFSpec, key: str, vtype: int, value: Any) -> GGUFSpec:
    spec.meta = [(k, t, v) if k != key else (k, vtype, value) for k, t, v in spec.meta]
    if key not in [k for k, _, _ in spec.meta]:
        spec.meta.append((key, vtype, value))
    return spec


def _without_meta(spec: GGUFSpec, key: str) -> GGUFSpec:
    spec.meta = [m for m in spec.meta if m[0] != key]
    return spec


def _map_tensor(spec: GGUFSpec, name: str, edit: Callable[[tuple], tuple]) -> GGUFSpec:
    spec.tensors = [edit(t) if t[0] == name else t for t in spec.tensors]
    return spec


# -- cases --------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One hostile input. ``build(dir)`` writes it and returns the model path; ``op`` is what the runner
    does with it: "load" (kvcore.loaders.load_model), "chat" (load, then render the chat template) or
    "generate" (an Engine generates 4 tokens); ``error`` the kvcore error class expected (None: it must
    work, and ``verify`` if given checks the result), ``match`` a substring the message must hold."""

    name: str
    build: Callable[[Path], Path]
    error: str | None = "ModelLoadError"
    match: str = ""
    op: str = "load"
    user: int | None = None  # run as this uid (a permission case, when the tests run as root)
    verify: str | None = None  # a check of run_cases.VERIFY for a case that must work


def _gguf(spec_or_bytes: GGUFSpec | bytes | Callable[[], GGUFSpec | bytes]) -> Callable[[Path], Path]:
    def build(where: Path) -> Path:
        made = spec_or_bytes() if callable(spec_or_bytes) else spec_or_bytes
        raw = made.encode()[0] if isinstance(made, GGUFSpec) else made
        path = where / "model.gguf"
        path.write_bytes(raw)
        return path

    return build


def _gguf_unreadable(where: Path) -> Path:
    path = _gguf(base_spec)(where)
    path.chmod(0)
    return path


def _truncated(section: str, delta: int) -> Callable[[], bytes]:
    def make() -> bytes:
        raw, marks = base_spec().encode()
        return raw[: marks[section] + delta]

    return make


def _patched(edit: Callable[[GGUFSpec], GGUFSpec]) -> Callable[[], GGUFSpec]:
    return lambda: edit(base_spec())


def _raw_patch(find: bytes, replace: bytes) -> Callable[[], bytes]:
    def make() -> bytes:
        raw = base_spec().encode()[0]
        assert raw.count(find) >= 1, find
        return raw.replace(find, replace, 1)

    return make


def _huge_array_length() -> bytes:
    """The token array claims 2^40 elements (the reader looped for ever on this)."""
    raw = base_spec().encode()[0]
    head = _str("tokenizer.ggml.tokens") + struct.pack("<I", ARR) + struct.pack("<I", STR)
    at = raw.index(head) + len(head)
    return raw[:at] + struct.pack("<Q", 1 << 40) + raw[at + 8 :]


def _overlapping() -> GGUFSpec:
    spec = base_spec()
    _, marks = spec.encode()
    offsets, pos = [], 0
    for *_, data in spec.tensors:
        offsets.append(pos)
        pos += -(-len(data) // 32) * 32
    offsets[1] = offsets[0]  # the second tensor reuses the first one's bytes
    spec.offsets = offsets
    return spec


def _offsets(edit: Callable[[list[int]], None]) -> Callable[[], GGUFSpec]:
    def make() -> GGUFSpec:
        spec = base_spec()
        offsets, pos = [], 0
        for *_, data in spec.tensors:
            offsets.append(pos)
            pos += -(-len(data) // 32) * 32
        edit(offsets)
        spec.offsets = offsets
        return spec

    return make


def _set_item(items: list[int], index: int, value: int) -> None:
    items[index] = value


def _gemma3_gguf(key: str, vtype: int, value: Any) -> GGUFSpec:
    """The tiny model's metadata as a Gemma 3 file (``gemma3.*`` keys) with ``gemma3.<key>`` set."""
    meta = [(k.replace("llama.", "gemma3.", 1) if isinstance(k, str) else k, t, v) for k, t, v in base_meta()]
    spec = GGUFSpec(meta, base_tensors())
    _set_meta(spec, "general.architecture", STR, "gemma3")
    return _set_meta(spec, f"gemma3.{key}", vtype, value)


def gguf_cases() -> list[Case]:
    t = GGUFSpec
    q_name = "blk.0.attn_q.weight"
    cases = [
        Case("gguf_valid", _gguf(base_spec), error=None, op="generate", verify="tiny_weights"),
        Case("gguf_empty", _gguf(b""), match="empty"),
        Case("gguf_bad_magic", _gguf(lambda: base_spec(magic=b"GGML")), match="bad magic"),
        Case("gguf_version_1", _gguf(lambda: base_spec(version=1)), match="unsupported version 1"),
        Case("gguf_version_big_endian", _gguf(lambda: base_spec(version=3 << 24)), match="big-endian"),
        Case("gguf_huge_kv_count", _gguf(lambda: base_spec(num_kv=1 << 40)), match="metadata keys"),
        Case("gguf_huge_tensor_count", _gguf(lambda: base_spec(num_tensors=1 << 40)), match="tensors"),
        Case("gguf_huge_array_length", _gguf(_huge_array_length), match="tokenizer.ggml.tokens"),
        Case("gguf_huge_key_length", _gguf(_raw_patch(_str("general.architecture"),
                                                      struct.pack("<Q", 1 << 62) + b"general.architecture")),
             match="metadata key #0"),
        Case("gguf_huge_string_value",
             _gguf(_raw_patch(_str(TEMPLATE), struct.pack("<Q", 1 << 40) + TEMPLATE.encode())),
             match="tokenizer.chat_template"),
        Case("gguf_bad_value_type", _gguf(_raw_patch(_str("tokenizer.ggml.bos_token_id") + struct.pack("<I", U32),
                                                     _str("tokenizer.ggml.bos_token_id") + struct.pack("<I", 99))),
             match="invalid value type 99"),
        Case("gguf_bad_array_type", _gguf(_raw_patch(struct.pack("<II", ARR, F32) + struct.pack("<Q", VOCAB),
                                                     struct.pack("<II", ARR, 77) + struct.pack("<Q", VOCAB))),
             match="invalid element type 77"),
        Case("gguf_nested_arrays", _gguf(_patched(lambda s: _set_meta(
            s, "general.nested", ARR, (ARR, [(ARR, [(U8, [1])])])))), match="nests arrays"),
        Case("gguf_duplicate_key", _gguf(_patched(lambda s: t(s.meta + [s.meta[0]], s.tensors))), match="duplicate"),
        Case("gguf_alignment_not_power_of_two", _gguf(_patched(lambda s: _set_meta(s, "general.alignment", U32, 24))),
             match="power of two"),
        Case("gguf_alignment_string", _gguf(_patched(lambda s: _set_meta(s, "general.alignment", STR, "32"))),
             match="must be a uint32"),
        Case("gguf_non_utf8_key", _gguf(_patched(lambda s: _set_meta(s, b"general.\xff\xfe", U32, 1))),
             match="UTF-8"),
        Case("gguf_non_utf8_template", _gguf(lambda: GGUFSpec(base_meta(template=b"{{ x }}\xff\xfe"), base_tensors())),
             match="UTF-8"),
        Case("gguf_tensor_5_dims", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], (16, 4, 2, 1, 2), x[2], x[3])))), match="5 dimensions"),
        Case("gguf_tensor_dim_zero", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], (16, 0), x[2], x[3])))), match="must be > 0"),
        Case("gguf_tensor_dim_huge", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], (16, 1 << 58), x[2], x[3])))), match="past the end"),
        Case("gguf_tensor_dim_negative", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], (16, -16), x[2], x[3])))), match="must be > 0"),
        Case("gguf_tensor_unknown_type", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], x[1], 200, x[3])))), match="unknown ggml type 200"),
        Case("gguf_tensor_block_mismatch", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], x[1], GGML_Q8_0, x[3])))), match="block size 32"),
        Case("gguf_tensor_unsupported_type", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], x[1], 26, x[3])))), match="unsupported type I32"),
        Case("gguf_tensor_name_too_long", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: ("x" * 100, *x[1:])))), match="limit 63"),
        Case("gguf_duplicate_tensor", _gguf(_patched(lambda s: t(s.meta, s.tensors + [s.tensors[0]]))),
             match="duplicate tensor"),
        Case("gguf_offset_unaligned", _gguf(_offsets(lambda o: _set_item(o, 3, o[3] + 4))), match="alignment"),
        Case("gguf_offset_overlapping", _gguf(_overlapping), match="overlap"),
        Case("gguf_offset_past_end", _gguf(_offsets(lambda o: _set_item(o, 5, 1 << 40))), match="past the end"),
        Case("gguf_wrong_shape", _gguf(_patched(lambda s: _map_tensor(
            s, q_name, lambda x: (x[0], (16, 8), x[2], x[3][: 16 * 8 * 4])))), match="has shape"),
        Case("gguf_missing_tensor", _gguf(_patched(lambda s: t(s.meta, [x for x in s.tensors if x[0] != q_name]))),
             match="missing tensor"),
        Case("gguf_vocab_mismatch", _gguf(_patched(lambda s: _set_meta(s, "llama.vocab_size", U32, 48))),
             match="has shape"),
        Case("gguf_block_count_1e9", _gguf(_patched(lambda s: _set_meta(s, "llama.block_count", U32, 10**9))),
             match="block_count"),
        Case("gguf_block_count_3", _gguf(_patched(lambda s: _set_meta(s, "llama.block_count", U32, 3))),
             match="declares 3 layers"),
        Case("gguf_head_count_0", _gguf(_patched(lambda s: _set_meta(s, "llama.attention.head_count", U32, 0))),
             match="attention.head_count"),
        Case("gguf_head_count_kv_0", _gguf(_patched(lambda s: _set_meta(s, "llama.attention.head_count_kv", U32, 0))),
             match="head_count_kv"),
        Case("gguf_heads_not_dividing", _gguf(_patched(lambda s: _set_meta(s, "llama.attention.head_count", U32, 3))),
             match="'"),
        Case("gguf_embedding_length_1e9", _gguf(_patched(lambda s: _set_meta(s, "llama.embedding_length", U64, 10**9))),
             match="embedding_length"),
        Case("gguf_epsilon_string", _gguf(_patched(lambda s: _set_meta(
            s, "llama.attention.layer_norm_rms_epsilon", STR, "tiny"))), match="layer_norm_rms_epsilon"),
        Case("gguf_rope_theta_string", _gguf(_patched(lambda s: _set_meta(s, "llama.rope.freq_base", STR, "fast"))),
             match="rope.freq_base"),
        Case("gguf_rope_theta_nan", _gguf(_patched(lambda s: _set_meta(s, "llama.rope.freq_base", F32, float("nan")))),
             match="rope.freq_base"),
        Case("gguf_block_count_string", _gguf(_patched(lambda s: _set_meta(s, "llama.block_count", STR, "2"))),
             match="block_count"),
        Case("gguf_tokens_not_strings", _gguf(_patched(lambda s: _set_meta(
            s, "tokenizer.ggml.tokens", ARR, (U32, list(range(VOCAB)))))), match="array of str"),
        Case("gguf_scores_short", _gguf(_patched(lambda s: _set_meta(
            s, "tokenizer.ggml.scores", ARR, (F32, [0.0] * 5)))),
             match="5 entries for 40 tokens"),
        Case("gguf_duplicate_tokens", _gguf(_patched(lambda s: _set_meta(
            s, "tokenizer.ggml.tokens", ARR, (STR, ["a"] * VOCAB)))), match="duplicate"),
        Case("gguf_bos_out_of_vocab", _gguf(_patched(lambda s: _set_meta(
            s, "tokenizer.ggml.bos_token_id", U32, 10**6))),
             match="not a token id"),
        Case("gguf_eos_negative", _gguf(_patched(lambda s: _set_meta(s, "tokenizer.ggml.eos_token_id", I32, -5))),
             match="not a token id"),
        Case("gguf_bpe_merges_not_strings", _gguf(_patched(lambda s: _set_meta(_set_meta(
            s, "tokenizer.ggml.model", STR, "gpt2"), "tokenizer.ggml.merges", ARR, (U32, [1, 2])))),
             match="array of str"),
        Case("gguf_unreadable", _gguf_unreadable, match="Permission denied", user=65534),
        Case("gguf_nan_weights", _gguf(lambda: GGUFSpec(base_meta(), base_tensors(_poisoned(np.nan)))),
             match="'model.layers.0.mlp.down_proj.weight' holds NaN or infinite"),
        Case("gguf_context_1e8", _gguf(_patched(lambda s: _set_meta(s, "llama.context_length", U32, 10**8))),
             error=None, op="generate"),
        Case("gguf_template_hang", _gguf(lambda: GGUFSpec(base_meta(template=HANG_TEMPLATE), base_tensors())),
             error="ChatTemplateError", match="did not finish", op="chat"),
        Case("gguf_template_explode", _gguf(lambda: GGUFSpec(base_meta(template=EXPLODE_TEMPLATE), base_tensors())),
             error="ChatTemplateError", match="limit", op="chat"),
    ]
    cases += [  # Gemma 3 options llama.cpp writes (the tiny model's tensors: the metadata is refused first)
        Case("gguf_gemma3_local_base_string", _gguf(lambda: _gemma3_gguf("rope.freq_base_swa", STR, "fast")),
             match="rope.freq_base_swa"),
        Case("gguf_gemma3_local_base_0", _gguf(lambda: _gemma3_gguf("rope.freq_base_swa", F32, 0.0)),
             match="rope_local_base_freq must be > 0"),
        Case("gguf_gemma3_softcap_0", _gguf(lambda: _gemma3_gguf("final_logit_softcapping", F32, 0.0)),
             match="final_logit_softcapping must be > 0"),
        Case("gguf_gemma3_window_string", _gguf(lambda: _gemma3_gguf("attention.sliding_window", STR, "wide")),
             match="sliding_window must be an integer in [1, "),
    ]
    for section, delta in (("kv", -10), ("kv", 3), ("kv", 400), ("tensor_infos", -2), ("tensor_infos", 30),
                           ("data", 0), ("data", 1000), ("end", -1)):
        cases.append(Case(f"gguf_truncated_{section}_{delta:+d}".replace("+", "p").replace("-", "m"),
                          _gguf(_truncated(section, delta)), match="GGUF"))
    return cases


# -- Hugging Face directories -------------------------------------------------------------------------
def hf_config(**changes: Any) -> dict[str, Any]:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": CONTEXT,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2}
    cfg.update(changes)
    return cfg


def gemma3_config(**changes: Any) -> dict[str, Any]:
    """The tiny model's config as a Gemma 3 text model (a window on five of every six layers)."""
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 8,
              "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}
    return hf_config(**{**gemma3, **changes})


#: architecture names of the windowed families besides Gemma (their other options stay the tiny model's)
WINDOWED = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "phi3": "Phi3ForCausalLM"}


def windowed_config(family: str, **changes: Any) -> dict[str, Any]:
    """The tiny model's config as ``family`` with a window of 8 on every layer (Qwen: ``use_sliding_window``)."""
    windowed = {"architectures": [WINDOWED[family]], "model_type": family, "sliding_window": 8,
                "use_sliding_window": True, "max_window_layers": 0}
    return hf_config(**{**windowed, **changes})


def hf_weights() -> dict[str, np.ndarray]:
    """The tiny model under Hugging Face names (row order does not matter for random weights)."""
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    out = {}
    for name, value in tiny_weights().items():
        stem = name.removesuffix(".weight")
        if stem.startswith("blk."):
            _, i, part = stem.split(".", 2)
            out[f"model.layers.{i}.{layer[part]}.weight"] = value
        else:
            out[names[stem] + ".weight"] = value
    return out


def _hf_poisoned(value: float) -> dict[str, np.ndarray]:
    weights = hf_weights()
    weights["model.layers.1.self_attn.o_proj.weight"][0, 0] = value
    return weights


def safetensors_bytes(tensors: dict[str, np.ndarray], header_edit: Callable[[dict], None] | None = None) -> bytes:
    """A safetensors file written by hand (8-byte header length, JSON header, data), so the header can lie."""
    header: dict[str, Any] = {}
    data = bytearray()
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if header_edit:
        header_edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def _hf(config: Any = None, weights: bytes | None = None, template: bytes | None = None,
        config_raw: bytes | None = None, chmod: int | None = None) -> Callable[[Path], Path]:
    def build(where: Path) -> Path:
        path = where / "model"
        path.mkdir()
        raw = config_raw if config_raw is not None else json.dumps(hf_config() if config is None else config).encode()
        (path / "config.json").write_bytes(raw)
        (path / "tokenizer.json").write_text(_tokenizer_json())
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
        (path / "model.safetensors").write_bytes(weights if weights is not None else safetensors_bytes(hf_weights()))
        if template is not None:
            (path / "chat_template.jinja").write_bytes(template)
        if chmod is not None:
            (path / "config.json").chmod(chmod)
        return path

    return build


def _hf_unreadable_dir(where: Path) -> Path:
    path = _hf()(where)
    path.chmod(0)
    return path


def _st(edit: Callable[[dict], None]) -> bytes:
    return safetensors_bytes(hf_weights(), edit)


def _st_entry(key: str, **changes: Any) -> Callable[[dict], None]:
    return lambda h: h[key].update(changes)


def hf_cases() -> list[Case]:
    q = "model.layers.0.self_attn.q_proj.weight"
    valid = safetensors_bytes(hf_weights())
    deep = b"[" * 2000 + b"]" * 2000
    return [
        Case("hf_valid", _hf(), error=None, op="generate", verify="hf_weights"),
        Case("hf_st_header_past_end", _hf(weights=struct.pack("<Q", 1 << 40) + valid[8:]), match="safetensors"),
        Case("hf_st_truncated", _hf(weights=valid[: len(valid) // 2]), match="safetensors"),
        Case("hf_st_bad_json", _hf(weights=struct.pack("<Q", 16) + b"{not json at all"), match="safetensors"),
        Case("hf_st_dtype_shape_mismatch", _hf(weights=_st(_st_entry(q, shape=[16, 17]))), match="safetensors"),
        Case("hf_st_offsets_out_of_range", _hf(weights=_st(_st_entry(q, data_offsets=[0, 1 << 40]))),
             match="safetensors"),
        Case("hf_st_unknown_dtype", _hf(weights=_st(_st_entry(q, dtype="Q4")))),
        Case("hf_st_int_dtype", _hf(weights=_st(_st_entry(q, dtype="I32"))), match="unsupported dtype"),
        Case("hf_inf_weights", _hf(weights=safetensors_bytes(_hf_poisoned(np.inf))),
             match="'model.layers.1.self_attn.o_proj.weight' holds NaN or infinite"),
        Case("hf_wrong_shape", _hf(config=hf_config(intermediate_size=48)), match="has shape"),
        Case("hf_config_not_object", _hf(config_raw=b"[1, 2, 3]"), match="JSON object"),
        Case("hf_config_bad_json", _hf(config_raw=b"{\"vocab_size\": 40,"), match="not valid JSON"),
        Case("hf_config_deep", _hf(config_raw=b'{"a": ' + deep + b"}"), match="config.json"),
        Case("hf_config_unreadable", _hf(chmod=0), match="cannot read", user=65534),
        Case("hf_dir_unreadable", _hf_unreadable_dir, match="permission denied", user=65534),
        Case("hf_layers_1e9", _hf(config=hf_config(num_hidden_layers=10**9)), match="num_hidden_layers"),
        Case("hf_layers_3", _hf(config=hf_config(num_hidden_layers=3)), match="declares 3 layers"),
        Case("hf_heads_zero", _hf(config=hf_config(num_attention_heads=0)), match="num_attention_heads"),
        Case("hf_vocab_huge", _hf(config=hf_config(vocab_size=1 << 22, hidden_size=1 << 17)),
             match="expected [4194304, 131072]"),
        Case("hf_epsilon_string", _hf(config=hf_config(rms_norm_eps="small")), match="rms_norm_eps"),
        Case("hf_rope_theta_string", _hf(config=hf_config(rope_theta="fast")), match="rope_theta"),
        Case("hf_rope_parameters_string", _hf(config=hf_config(rope_parameters="yarn")), match="rope_parameters"),
        Case("hf_eos_not_an_id", _hf(config=hf_config(eos_token_id=["x"])), match="eos_token_id"),
        Case("hf_bos_out_of_vocab", _hf(config=hf_config(bos_token_id=10**6)), match="not a token id"),
        Case("hf_tie_string", _hf(config=hf_config(tie_word_embeddings="no")), match="tie_word_embeddings"),
        Case("hf_rope_factors_string", _hf(config=hf_config(rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": "abc",
            "long_factor": "def"})), match="short_factor"),
        Case("hf_layers_bool", _hf(config=hf_config(num_hidden_layers=True)), match="num_hidden_layers"),
        Case("hf_max_position_1e8", _hf(config=hf_config(max_position_embeddings=10**8)), error=None, op="generate"),
        # Gemma 3 options out of range: each a ModelLoadError naming the key and its range
        Case("hf_gemma3_pattern_0", _hf(config=gemma3_config(sliding_window_pattern=0)),
             match="sliding_window_pattern must be an integer in [1, "),
        Case("hf_gemma3_pattern_inf", _hf(config=gemma3_config(sliding_window_pattern=float("inf"))),
             match="sliding_window_pattern must be an integer in [1, "),
        Case("hf_gemma3_local_rope_not_object", _hf(config=gemma3_config(rope_parameters={
            "full_attention": {"rope_theta": 1e6}, "sliding_attention": 5})),
             match="sliding_attention must be an object"),
        Case("hf_gemma3_local_base_0", _hf(config=gemma3_config(rope_local_base_freq=0)),
             match="rope_local_base_freq must be > 0"),
        Case("hf_gemma3_query_scalar_0", _hf(config=gemma3_config(query_pre_attn_scalar=0)),
             match="query_pre_attn_scalar must be > 0"),
        Case("hf_gemma3_softcap_0", _hf(config=gemma3_config(final_logit_softcapping=0)),
             match="final_logit_softcapping must be > 0"),
        Case("hf_gemma3_window_inf", _hf(config=gemma3_config(sliding_window=float("inf"))),
             match="sliding_window must be an integer in [1, "),
        # the other windowed families: JSON's Infinity once reached int() (OverflowError, an internal error)
        *[Case(f"hf_{family}_window_inf", _hf(config=windowed_config(family, sliding_window=float("inf"))),
               match="config.json: sliding_window must be an integer in [1, ")
          for family in ("mistral", "qwen2", "qwen3", "phi3")],
        Case("hf_qwen3_layer_types_window_inf", _hf(config=windowed_config(
            "qwen3", sliding_window=float("inf"), layer_types=["sliding_attention"] * LAYERS)),
             match="config.json: sliding_window must be an integer in [1, "),
        Case("hf_qwen2_max_window_layers_inf", _hf(config=windowed_config("qwen2", max_window_layers=float("inf"))),
             match="config.json: max_window_layers must be an integer in [0, "),
        Case("hf_template_non_utf8", _hf(template=b"{{ messages }}\xff\xfe"), match="UTF-8"),
        Case("hf_template_explode", _hf(template=EXPLODE_TEMPLATE.encode()), error="ChatTemplateError",
             match="limit", op="chat"),
        Case("hf_template_invalid", _hf(template=b"{% for %}"), error="ChatTemplateError", match="invalid Jinja",
             op="chat"),
    ]


def all_cases() -> dict[str, Case]:
    cases = gguf_cases() + hf_cases()
    by_name = {c.name: c for c in cases}
    assert len(by_name) == len(cases), "case names must be unique"
    return by_name


def write_corpus(root: Path) -> dict[str, Path]:
    """Every case under ``root/<name>/``; returns case name -> model path."""
    paths = {}
    for name, case in all_cases().items():
        where = root / name
        where.mkdir(parents=True, exist_ok=True)
        paths[name] = case.build(where)
    return paths


if __name__ == "__main__":
    for name, path in write_corpus(Path(sys.argv[1])).items():
        print(f"{name}\t{path}")

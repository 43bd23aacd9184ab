"""kvcore's own GGUF metadata reader (kvcore/loaders/gguf_metadata.py): the values the ``gguf`` package's reader
gives, of the same Python types, without its per-value objects; tensors' bytes as that reader shapes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from helpers import FastGGUFReader

from kvcore.errors import ModelLoadError
from kvcore.loaders.gguf_metadata import read_gguf, tensor_data


def _reference(path) -> dict:
    reader = FastGGUFReader(path)
    return {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert type(got[key]) is type(value) and got[key] == value, key
        if isinstance(value, list):
            assert [type(v) for v in got[key]] == [type(v) for v in value], key


def test_every_value_type_reads_as_the_gguf_reader_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)  # a float32 value: 0.10000000149011612 as Python reads it
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ⟨chat⟩")
    writer.add_array("t.strings", ["a", "", "ĠĊ", "tokén"])
    writer.add_array("t.floats", [0.5, -1.25, 3.1])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    weight = np.arange(64 * 3, dtype=np.float32).reshape(3, 64)
    writer.add_tensor("f32", weight)
    writer.add_tensor("q8", gguf.quants.quantize(weight, QType.Q8_0), raw_dtype=QType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    layout, metadata = read_gguf(path)
    _assert_same(metadata, _reference(path))
    assert metadata["t.f32"] == float(np.float32(0.1)) and metadata["t.u64"] == 2**63 + 5
    reader = FastGGUFReader(path)
    for info, tensor in zip(layout.tensors, reader.tensors):
        data = tensor_data(path, info)
        assert data.dtype == tensor.data.dtype and data.shape == tensor.data.shape
        assert np.array_equal(data, tensor.data) and data.flags.writeable  # its own copy, not the file's pages


def test_a_string_that_is_not_utf8_is_a_load_error(tmp_path):
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["ok", "XX"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"XX", b"\xff\xfe"))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file.*utf-8"):
        read_gguf(path)


@pytest.mark.slow
def test_the_embedded_models_metadata_is_the_gguf_readers():
    from kvcore.loaders.resolve import smollm2_path

    _, metadata = read_gguf(smollm2_path())
    _assert_same(metadata, _reference(smollm2_path()))
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152

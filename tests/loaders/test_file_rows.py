"""A GGUF token table read from the file per lookup (kvcore/loaders/file_rows.py): the rows are those the blocks
decode to, the process holds no copy of the table, and a file changed under it is an error, not other rows."""

from __future__ import annotations

import os
import types

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from kvcore.errors import ModelFileChangedError, ModelLoadError
from kvcore.kernels.cpu_kernels import kernel_reasons, load_kernels
from kvcore.loaders.gguf_blocks import GGUFBlocks, file_blocks
from kvcore.loaders.watched import model_file_problem
from kvcore.model.embedding import BlockTable

_OFFSET = 4096 + 160  # a tensor's data after a header, at no particular alignment


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _table_file(path, rows: int, cols: int, seed: int = 0) -> tuple[GGUFBlocks, np.ndarray]:
    """A file with random Q8_0 rows (finite scales) at ``_OFFSET`` between other bytes; its blocks as the loader
    gives them (a reader of that range) and the rows' bytes."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    d = (rng.standard_normal(n) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, 2)
    data = np.concatenate([d, rng.integers(0, 256, (n, 32), dtype=np.uint8)], axis=1).reshape(rows, -1)
    path.write_bytes(b"\x07" * _OFFSET + data.tobytes() + b"\xff" * 999)
    return GGUFBlocks(QType.Q8_0, file_blocks(path, _OFFSET, data.nbytes), (rows, cols)), data


def test_rows_read_from_the_file_are_the_rows_the_blocks_decode_to(tmp_path):
    blocks, data = _table_file(tmp_path / "t.gguf", 300, 128)
    table = blocks.lookup_table()
    assert table.in_file and not blocks.resident().in_file
    reference = torch.from_numpy(gguf.quants.dequantize(data, QType.Q8_0).reshape(300, 128))
    index = torch.tensor([299, 0, 7, 7, 150, 1])  # the first and last rows, repeats, any order
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(table.rows(index, dtype), reference[index].to(dtype))
        assert torch.equal(table.rows(slice(10, 290, 3), dtype), reference[10:290:3].to(dtype))
        assert torch.equal(table.rows(slice(None), dtype), reference.to(dtype))  # one read of every row
    held = BlockTable(table, torch.bfloat16)
    assert torch.equal(held(index), reference[index].to(torch.bfloat16))
    assert table.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 128)
    with pytest.raises(IndexError):
        table.rows(torch.tensor([300]))  # past the table: the bytes after it are not a row
    with pytest.raises(IndexError):
        table.rows(torch.tensor([-1]))


def test_rows_read_once_are_kept_up_to_the_cache_size(tmp_path):
    path = tmp_path / "t.gguf"
    blocks, data = _table_file(path, 64, 64)
    rows = blocks._file.rows(64, cache_rows=8)
    first = rows[torch.tensor([3, 4, 3])]
    assert torch.equal(first, torch.from_numpy(data[[3, 4, 3]])) and rows._used == 2
    for start in range(0, 60, 3):  # past the cache's 8 rows: it starts over, the rows stay right
        index = torch.tensor([start, start + 2, start + 1, start])
        assert torch.equal(rows[index], torch.from_numpy(data[index.numpy()])) and rows._used <= 8
    many = torch.tensor([9, 1, 50, 2, 63])  # more than half the cache: read directly
    assert torch.equal(rows[many], torch.from_numpy(data[many.numpy()]))
    rows[torch.tensor([3, 4])]
    path.write_bytes(path.read_bytes()[: _OFFSET + 10 * data.shape[1]])  # truncated in place
    assert torch.equal(rows[torch.tensor([4, 3])], first[[1, 0]])  # kept rows: no read, the rows first read
    with pytest.raises(ModelLoadError):
        rows[torch.tensor([5])]


def test_the_table_is_not_copied_into_the_process(tmp_path):
    blocks, _ = _table_file(tmp_path / "big.gguf", 64 * 1024, 1024)  # 68 MiB of Q8_0 rows, in the page cache
    before = _rss_bytes()
    table = BlockTable(blocks.lookup_table(), torch.bfloat16)
    for _ in range(50):
        table[torch.randint(0, 64 * 1024, (64,))]  # rows spread over the whole table, as rescored candidates are
    assert table.nbytes == blocks.nbytes == 64 * 1024 * 1088
    assert _rss_bytes() - before < 8 << 20  # held, or mapped, it would be the table's 68 MiB


def test_a_file_replaced_keeps_its_rows_and_one_written_over_is_an_error(tmp_path):
    path = tmp_path / "t.gguf"
    blocks, data = _table_file(path, 64, 64)
    table = blocks.lookup_table()
    want = table.rows(torch.tensor([5, 9]))
    _table_file(tmp_path / "new.gguf", 64, 64, seed=1)
    os.replace(tmp_path / "new.gguf", path)  # a new file at the path: the open one is still read
    assert torch.equal(table.rows(torch.tensor([5, 9])), want)

    blocks, _ = _table_file(path, 64, 64)
    table = blocks.lookup_table()
    with open(path, "r+b") as f:  # the same bytes written over in place: the file changed while in use
        f.seek(_OFFSET)
        f.write(data.tobytes())
        os.utime(f.fileno(), ns=(0, 0))
    with pytest.raises(ModelLoadError, match="written to while in use"):
        table.rows(torch.tensor([5]))


def test_the_engine_sees_a_token_table_file_changed_in_place_before_reading_it(tmp_path):
    """A model whose token table is read from its GGUF (kvcore/loaders/watched.py): the engine's check names the
    file once it was written to, and a read then fails with ModelFileChangedError, not other rows."""
    path = tmp_path / "t.gguf"
    blocks, data = _table_file(path, 64, 64)
    model = types.SimpleNamespace(embedding=BlockTable(blocks.lookup_table(), torch.float32), mapped_files=[])
    assert model_file_problem(model) is None
    with open(path, "r+b") as f:
        f.seek(_OFFSET)
        f.write(data.tobytes())
        os.utime(f.fileno(), ns=(0, 0))
    assert f"model file '{path}' was written to while in use" in model_file_problem(model)
    with pytest.raises(ModelFileChangedError, match="written to while in use"):
        model.embedding(torch.tensor([5]))
    model.embedding.blocks = None  # as BlockTable.dense() leaves it: nothing is read from the file any more
    assert model_file_problem(model) is None


@pytest.mark.skipif(bool(kernel_reasons()), reason="; ".join(kernel_reasons()))
def test_kept_rows_are_decoded_natively_as_the_rows_read(tmp_path):
    """A lookup whose rows are all kept is one native call (gather and decode); the rows are those read, also after
    the cache started over; a row not kept, or outside the table, leaves the lookup to the reads."""
    load_kernels()
    blocks, data = _table_file(tmp_path / "t.gguf", 64, 64)
    reference = torch.from_numpy(gguf.quants.dequantize(data, QType.Q8_0).reshape(64, 64)).bfloat16()
    table = GGUFBlocks(QType.Q8_0, blocks._file, (64, 64))
    table._table = blocks._file.rows(64, cache_rows=8)
    kept = table._table.kept
    native = torch.ops.kvcore.q8_0_kept_rows
    assert native(*kept, torch.tensor([3]), 64, torch.bfloat16).shape == (0, 64)  # nothing kept yet
    for start in range(0, 60, 3):  # the cache of 8 rows starts over again and again
        index = torch.tensor([start, start + 2, start + 1, start])
        assert torch.equal(table.rows(index, torch.bfloat16), reference[index])  # read, then kept
        got = native(*kept, index, 64, torch.bfloat16)
        assert torch.equal(got, reference[index]) and torch.equal(table.rows(index, torch.bfloat16), got)
    for outside in ([64], [-1], [start, 2]):  # past the table, negative, a row the cache no longer holds
        assert native(*kept, torch.tensor(outside), 64, torch.bfloat16).shape == (0, 64)
    with pytest.raises(IndexError):
        table.rows(torch.tensor([64]))

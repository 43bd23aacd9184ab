"""Why kvcore reads the GGUF token table with ``pread`` instead of mapping the file: the rows a greedy generation
reads from the table (embedding lookups and the int4 head's 64 rescored candidates per step), counted as distinct
rows and as the 4 KiB / 64 KiB / 1 MiB pieces of the file they fall in; and what one read through a memory map of
the file adds to the process's resident memory (``RssFile``) on this kernel, page cache warm. Linux only::

    python benchmarks/studies/table_pages.py [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import mmap

import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.loaders.gguf_validate import validate_gguf
from kvcore.loaders.resolve import smollm2_path
from kvcore.model import embedding


def rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = Engine.from_pretrained("smollm2", EngineConfig(max_model_len=args.max_new_tokens + 16, max_num_seqs=1))
    table = engine.model.embedding
    read: list[torch.Tensor] = []
    lookup = embedding.BlockTable.__getitem__

    def recording(self, index):
        if isinstance(index, torch.Tensor):
            read.append(index.reshape(-1).clone())
        return lookup(self, index)

    embedding.BlockTable.__getitem__ = recording
    engine.generate("Tell me a story about a dragon.", SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                       ignore_eos=True))
    embedding.BlockTable.__getitem__ = lookup
    rows = torch.cat(read)
    stored = next(t for t in validate_gguf(smollm2_path()).tensors if t.name == "token_embd.weight")
    width, offset = stored.nbytes // table.shape[0], stored.offset
    print(f"{args.max_new_tokens} tokens: {rows.numel()} row reads, {rows.unique().numel()} distinct rows of "
          f"{table.shape[0]} ({width} bytes each; the table {table.blocks.nbytes / 2**20:.1f} MiB)")
    for piece in (4 << 10, 64 << 10, 1 << 20):
        touched = {(offset + r * width + end) // piece for r in rows.tolist() for end in (0, width - 1)}
        print(f"  {piece >> 10} KiB pieces touched: {len(touched)} = {len(touched) * piece / 2**20:.1f} MiB")

    with open(smollm2_path(), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        f.read()  # the page cache warm, as after a model is built
        mapped.madvise(mmap.MADV_RANDOM)
        grown = []
        for r in (100, 20_000, 40_000):
            before = rss_file_kib()
            mapped[offset + r * width]
            grown.append(rss_file_kib() - before)
    print(f"one byte read through a map of the file (MADV_RANDOM), rows 100 / 20000 / 40000: RssFile +{grown} KiB")


if __name__ == "__main__":
    main()

"""Training text that every machine has: the standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256  # bytes: no tokenizer to ship or download


def load_stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """Concatenate the stdlib's top-level .py files in sorted order, up to `max_bytes`.

    Sorted, top-level only: the same bytes on every rank and every run of one interpreter.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"standard library source under {root} is too small ({len(text)} bytes)")
    return text


class StdlibTextDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size + 1` bytes; sample i is always the same window."""

    def __init__(self, block_size: int = 64, max_bytes: int = 4_000_000) -> None:
        self.block_size = block_size
        data = torch.frombuffer(bytearray(load_stdlib_text(max_bytes)), dtype=torch.uint8)
        self._data = data.to(torch.long)
        self._n = (len(self._data) - 1) // block_size

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._n:
            raise IndexError(f"sample index {index} out of range 0..{self._n - 1}")
        start = index * self.block_size
        window = self._data[start : start + self.block_size + 1]
        return window[:-1], window[1:]

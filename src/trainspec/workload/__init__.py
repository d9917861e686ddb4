"""The reference workload: a small character-level GPT on the Python standard library's source.

Contract: `StdlibTextDataset` is a deterministic, indexable dataset of byte windows taken from
the source files of the running interpreter's standard library (present on every machine, so
nothing is downloaded); `TinyGPT` is a decoder-only transformer over bytes. Both are plain
torch; they are the workload of the demo, the integration tests and every benchmark.
"""

from __future__ import annotations

from trainspec.workload.corpus import StdlibTextDataset, load_stdlib_text
from trainspec.workload.gpt import GPTConfig, TinyGPT

__all__ = ["GPTConfig", "StdlibTextDataset", "TinyGPT", "load_stdlib_text"]

"""The fast paths a benchmark may turn off to measure what each buys. All are on in normal use; nothing
but a benchmark or a test changes them, and ``off`` puts them back.

- ``cpu_matmul``: fp32 projections of 1-4 rows on CPU as ``w @ x.T`` (model/llama.py ``linear``);
- ``keep_codes``: views kept for a decode keep their unpacked correction codes (reuse/views/layout.py);
- ``compiled_views``: decode-sized attention over a view by the compiled CPU loops (reuse/views/compiled.py);
- ``plain_loops``: decode-sized attention over plain paged KV by the same loops (engine/paged_attention.py);
- ``rope_write``: a decode step's RoPE, KV write and attention in one call per layer
  (engine/paged_attention.py ``attend_qkv``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator


@dataclass
class Switches:
    cpu_matmul: bool = True
    keep_codes: bool = True
    compiled_views: bool = True
    plain_loops: bool = True
    rope_write: bool = True


SWITCHES = Switches()


@contextmanager
def off(*names: str) -> Iterator[Switches]:
    """Turn the named fast paths off for the block, then back to what they were."""
    known = {f.name for f in fields(Switches)}
    unknown = set(names) - known
    if unknown:
        raise ValueError(f"unknown switches {sorted(unknown)}; known: {sorted(known)}")
    saved = {n: getattr(SWITCHES, n) for n in names}
    try:
        for n in names:
            setattr(SWITCHES, n, False)
        yield SWITCHES
    finally:
        for n, v in saved.items():
            setattr(SWITCHES, n, v)

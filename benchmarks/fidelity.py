"""Fidelity of cross-agent KV reuse against exact prefill (issue 3's harness); same as ``kvcmas fidelity``.

    python -m benchmarks.fidelity [--quick] [--scenarios pipeline debate fanout] [--modes naive kvcmas prefix]
                                  [--eval-tokens 64] [--out benchmarks/results/fidelity]
"""
from __future__ import annotations

import sys

from kvcmas_agents.fidelity.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Every reuse method on the same multi-agent traces, side by side (issue 5); same as ``kvcmas bench``.

    python -m benchmarks.bench [--quick | --preset full|long] [--methods none prefix naive cacheblend kvcomm kvcmas]
                               [--model random:llama3-8b --device cuda] [--out benchmarks/results/bench]
"""
from __future__ import annotations

import sys

from kvcmas_agents.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

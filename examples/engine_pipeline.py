"""planner -> coder -> reviewer -> tester on one embedded kvcmas Engine.

    python examples/engine_pipeline.py --rounds 2 --max-tokens 96 --reuse prefix [--parallel-review]

The pipeline itself lives in ``kvcmas_agents.demos.engine_pipeline`` (also behind ``kvcmas engine-demo``); call
``run_pipeline(engine, task, rounds, max_tokens)`` from your own code to get per-turn records.
"""
from __future__ import annotations

import sys

from kvcmas_agents.demos.engine_pipeline import main

if __name__ == "__main__":
    sys.exit(main())

"""planner -> coder -> reviewer -> tester as a LangGraph graph on one embedded kvcmas engine.

    python examples/langgraph_pipeline.py [--rounds 2] [--max-tokens 48] [--reuse prefix]

The graph is defined in ``kvcmas_agents/demos/langgraph_pipeline.py`` (read it: ``build_graph`` is
a plain StateGraph whose nodes call one ``ChatKVCMAS``); it lives in the package so that the
installed ``kvcmas demo`` command runs the same code.
"""
from __future__ import annotations

import sys

from kvcmas_agents.demos.langgraph_pipeline import main

if __name__ == "__main__":
    sys.exit(main())

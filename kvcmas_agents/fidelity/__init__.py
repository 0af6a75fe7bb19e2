"""Fidelity harness: how close each cross-agent reuse mode stays to an exact prefill, per agent turn."""
from .harness import SweepGrid, run_fidelity
from .metrics import TurnMetrics, kl, kl_steps, turn_metrics
from .report import write_report
from .scenarios import DEBATE, FANOUT, PIPELINE, SCENARIOS, Scenario, get_scenario, prompt_messages
from .scenario_texts import CSV_SYSTEM, CSV_TASK

__all__ = ["run_fidelity", "SweepGrid", "kl", "kl_steps", "turn_metrics", "TurnMetrics", "write_report",
           "Scenario", "SCENARIOS", "PIPELINE", "DEBATE", "FANOUT", "get_scenario", "prompt_messages",
           "CSV_SYSTEM", "CSV_TASK"]

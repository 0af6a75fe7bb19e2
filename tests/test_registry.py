"""The process-wide engine registry: shared engines are closed when the interpreter exits."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_shared_engines_are_closed_at_interpreter_exit():
    """A script that leaves its shared engine open still stops the worker before torch is torn down
    (registry's atexit hook), and exits cleanly."""
    script = textwrap.dedent("""
        import atexit
        held = {}
        # registered before the registry's hook, so it runs after it (atexit is last in, first out)
        atexit.register(lambda: print("closed", held["e"]._closed, "alive", held["e"]._thread.is_alive()))
        from kvcmas_agents.registry import get_engine
        held["e"] = get_engine(reuse="prefix", device="cpu")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "closed True alive False" in proc.stdout

"""Optional Triton kernels (the ``triton`` extra). Plain tensors in, plain tensors out: nothing here
imports the engine. Import ``kvcmas_agents.kernels.view_attention`` lazily; ``triton_available`` and
``require_triton`` tell whether it can run without importing Triton eagerly elsewhere."""
from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def require_triton(device_type: str) -> None:
    """Raise a clear error when the Triton kernels cannot run on ``device_type`` ("cuda" or "cpu")."""
    if not triton_available():
        raise ImportError("view_path='triton' needs Triton: pip install 'kvcmas-agents[triton]'")
    if device_type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels need a CUDA device; on CPU set TRITON_INTERPRET=1 before "
                           "kvcmas_agents.kernels.view_attention is imported (slow, for tests)")

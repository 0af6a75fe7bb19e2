"""Kernel tests run natively on CUDA and in Triton's CPU interpreter elsewhere.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is decorated, i.e. before
``kvcmas_agents.kernels.view_attention`` is first imported; this conftest loads first.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Runnable multi-agent demos shipped with the package (``kvcmas demo``, ``examples/``).

They live in the package, not only in ``examples/``, so an installed ``kvcmas`` can run them.
"""

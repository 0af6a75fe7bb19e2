"""``kvcmas bench``: replay the same multi-agent traces through every reuse method and compare them.

traces (what is replayed), methods (how each baseline is configured), runner (timing, memory,
fidelity, throughput), report (JSON, markdown, plots), cli (options).
"""

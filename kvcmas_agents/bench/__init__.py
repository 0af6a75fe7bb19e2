"""``kvcmas bench``: replay the same multi-agent traces through every reuse method and compare them.

traces (what is replayed), methods (how each baseline is configured), runner (timing, memory,
fidelity, throughput), report (JSON, markdown, plots), cli (options, and the subcommands).

``kvcmas bench NAME``, one module each: parts (where a replay's time goes), turn_time, tool_loop and
decode_rate (later agents over the shared history of team_history), tool_choice, grammar_mask, soak,
scale_out (Ray replicas).
"""

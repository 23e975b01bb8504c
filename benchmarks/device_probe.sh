#!/usr/bin/env bash
# One prepared device run: the probe suite on a single GPU machine, records in one folder.
#   bash benchmarks/device_probe.sh [OUT_DIR]
# Wheels a GPU machine without package access lacks (pydantic, typer, rich, pyyaml ...) may be
# carried in .whl/; they are installed into /tmp/site first when present.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-docs/validation/records}}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
timeout 470 python3 benchmarks/device_probe.py "$OUT_DIR" "${@:2}"

#!/usr/bin/env bash
# Install (CPU torch wheel explicitly, then the package with its extras) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Running pip as" || true
"$PYTHON" -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Running pip as" || true
"$PYTHON" -c "import torch, opacus, opacus_fsdp_sync; print('torch', torch.__version__, 'opacus', opacus.__version__)"
"$PYTHON" -m ruff check opacus_fsdp_sync tests memory_test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
exec "$PYTHON" -m pytest -q --timeout=900 "$@"

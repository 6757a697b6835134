#!/usr/bin/env bash
# Upstream Opacus's single-device engine tests (installed with the opacus wheel, under
# opacus/tests/) with our PrivacyEngine swapped in (scripts/upstream_opacus_plugin.py). Not part
# of .ci/run: about ten minutes on two CPU cores. Counts are in docs/exactness.md.
# Extra arguments go to pytest. Environment overrides:
#   PYTHON               interpreter (default python3)
#   UPSTREAM_ENGINE      ours (default) | opacus (the baseline: upstream's own engine)
#   UPSTREAM_SEED_BRIDGE 1 (default): engines built without dp_seed take one from torch's
#                        global generator, as upstream's draws follow torch.manual_seed; 0: off
#   UPSTREAM_TESTS       test modules of opacus.tests (default: the three engine suites)
#   TORCHVISION_DIR      where torchvision is installed when missing (default
#                        .upstream-torchvision, git-ignored): the release matching torch,
#                        without dependencies, so that torch itself is never replaced
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
UPSTREAM_TESTS=${UPSTREAM_TESTS:-"privacy_engine_test randomness_test batch_memory_manager_test"}
TORCHVISION_DIR=${TORCHVISION_DIR:-$ROOT/.upstream-torchvision}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

extra_path=$ROOT/scripts:$ROOT
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchvision') is None)"; then
  if [ ! -d "$TORCHVISION_DIR/torchvision" ]; then
    # torchvision 0.(N+15) goes with torch 2.N
    spec=$("$PYTHON" -c "import torch; m = int(torch.__version__.split('.')[1]); print(f'torchvision==0.{m + 15}.*')")
    echo "installing $spec into $TORCHVISION_DIR (no dependencies)" >&2
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$TORCHVISION_DIR" "$spec"
  fi
  extra_path=$extra_path:$TORCHVISION_DIR
fi

modules=()
for name in $UPSTREAM_TESTS; do
  modules+=("opacus.tests.$name")
done
echo "engine: ${UPSTREAM_ENGINE:-ours}, seed bridge: ${UPSTREAM_SEED_BRIDGE:-1}" >&2
PYTHONPATH=$extra_path${PYTHONPATH:+:$PYTHONPATH} exec "$PYTHON" -m pytest -c /dev/null \
  --rootdir "$ROOT" -p no:cacheprovider -p upstream_opacus_plugin -q -rfE \
  --pyargs "${modules[@]}" "$@"

#!/usr/bin/env bash
# Install and run the tests on every tested torch release (the version gate's
# TESTED_TORCH_VERSIONS): the oldest supported one with $PYTHON (a CPU wheel), then the newest
# on the package index in a git-ignored virtual environment created here (kept, so a re-run
# on the same machine only checks it; pip's cache makes a fresh one faster too). Each run's
# torch is pinned in requirements/torch-{oldest,newest}.txt and installed from that file.
# Extra arguments go to pytest, on every run. Environment overrides:
#   PYTHON          interpreter for the oldest torch (default python3)
#   TORCH_OLDEST    oldest supported torch (default: requirements/torch-oldest.txt's pin)
#   TORCH_NEWEST    newest torch on the package index (default: requirements/torch-newest.txt's
#                   pin); another version than the file's is installed as torch==VERSION
#   NEWEST_VENV     where the newest torch's environment lives (default .venv-torch-newest)
#   TORCH_RUNS      which runs, in order (default "oldest newest")
#   NEWEST_PYTEST   pytest selection for the newest run only (default: the whole suite but the
#                   GPU campaign's CPU smoke run, which tests the shell script, not the torch
#                   release, and takes about 2 minutes; "" runs everything)
#   OFS_RANKS_START how the tests' gloo ranks start (opacus_fsdp_sync.testing.spawn): forked
#                   from a server that has imported torch once ("forkserver", the default), or
#                   each as a fresh interpreter ("spawn", about 3.5 s more per distributed test,
#                   each rank with its own string-hash seed, as torchrun starts them)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=requirements

pinned() {  # the version requirements/torch-$1.txt pins (torch==X)
  local file="$REQUIREMENTS/torch-$1.txt" version
  version=$(sed -n 's/^torch==\([^[:space:];#]*\).*/\1/p' "$file" | head -n 1)
  if [ -z "$version" ]; then
    echo "$file: no 'torch==VERSION' line" >&2
    return 1
  fi
  echo "$version"
}

PYTHON=${PYTHON:-python3}
TORCH_OLDEST=${TORCH_OLDEST:-$(pinned oldest)}
TORCH_NEWEST=${TORCH_NEWEST:-$(pinned newest)}
NEWEST_VENV=${NEWEST_VENV:-.venv-torch-newest}
TORCH_RUNS=${TORCH_RUNS:-"oldest newest"}
NEWEST_PYTEST=${NEWEST_PYTEST-"--deselect tests/test_gpu_campaign.py::test_tiny_cpu_smoke_run_writes_every_part"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

quiet_pip() {  # pip without the root-user warning; pip's own exit status is kept
  local py=$1
  shift
  "$py" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Running pip as" || true; }
  return "${PIPESTATUS[0]}"
}

# Installs torch $3 (from requirements/torch-$2.txt when that is the version it pins) and the
# package with its dev and kernels-test extras into interpreter $1, then runs ruff and pytest
# ($4...: pytest arguments). Returns the first failing step's exit status (pytest's when the
# tests fail). Called as `run_suite ... || overall=$?`, where bash ignores `set -e` inside it:
# every step checks its own status.
run_suite() {
  local py=$1 run=$2 torch_version=$3
  shift 3
  local start=$SECONDS pin
  pin=$(pinned "$run" 2>/dev/null) || pin=""  # an overriding version needs no file
  local torch_args=("torch==$torch_version")
  if [ "$torch_version" = "$pin" ]; then
    torch_args=(-r "$REQUIREMENTS/torch-$run.txt")
  fi
  quiet_pip "$py" "${torch_args[@]}" || return $?
  # The kernels-test extra (triton, for the fused kernels' tests under its CPU interpreter);
  # where it cannot be installed beside this torch, those tests skip and say why.
  if ! quiet_pip "$py" -e ".[dev,kernels-test]"; then
    echo "== triton (.[kernels-test]) does not install beside torch $torch_version:" \
      "the fused-kernel interpreter tests skip"
    quiet_pip "$py" -e ".[dev]" || return $?
  fi
  "$py" -c "import sys, torch, opacus, opacus_fsdp_sync; print('== tests on torch', \
torch.__version__, '| opacus', opacus.__version__, '| python', sys.version.split()[0], '|', \
sys.executable)" || return $?
  "$py" -m ruff check opacus_fsdp_sync tests memory_test || return $?
  local status=0
  "$py" -m pytest -q --timeout=900 -p no:cacheprovider "$@" || status=$?
  echo "== torch $torch_version: pytest exit status $status, $((SECONDS - start)) s (install included)"
  return "$status"
}

overall=0  # the last failing run's status (pytest's, when tests failed)
for run in $TORCH_RUNS; do
  case "$run" in
    oldest)
      run_suite "$PYTHON" oldest "$TORCH_OLDEST" "$@" || overall=$?
      ;;
    newest)
      if [ ! -x "$NEWEST_VENV/bin/python" ]; then
        "$PYTHON" -m venv "$NEWEST_VENV"  # without the system's packages: torch comes from pip
      fi
      extra=()
      if [ -n "$NEWEST_PYTEST" ]; then
        eval "extra=($NEWEST_PYTEST)"
      fi
      run_suite "$NEWEST_VENV/bin/python" newest "$TORCH_NEWEST" "${extra[@]}" "$@" || overall=$?
      ;;
    *)
      echo "unknown run '$run' in TORCH_RUNS (expected: oldest, newest)" >&2
      exit 2
      ;;
  esac
done
exit "$overall"

#!/usr/bin/env bash
# The whole GPU measurement in one command (issue 19): on one GPU, about 8 minutes (estimate
# below), well under 25 minutes of device time.
#   1. suite:   the profiling suite's rows at batch 8, seq 1024: no_dp, upstream ghost_fsdp, the
#               default (ghost_fsdp_one_backward, tune_norms="auto" = on for GPUs) and the
#               default with tuning off (ghost_fsdp_one_backward_untuned);
#   2. gram:    gram_blocks.py, the Linear ghost norms of one decoder block per gram_block;
#   3. profile: a torch.profiler per-op table and Chrome trace of one default step.
# Results go to results/<hardware>-campaign/ (hardware from nvidia-smi, else torch), with
# campaign.md naming the hardware, software, commands and each part's wall time.
# Environment overrides: PYTHON (default python3; the suite's scripts start it too), OUT, PARTS
# ("suite gram profile"), MODEL, BATCH_SIZE, SEQ_LENGTHS, STEPS, WARMUP, NPROC, GRAM_ARGS,
# PROFILE_STEPS, DRY_RUN=1 (print the commands only).
# CPU smoke test: MODEL=tiny BATCH_SIZE=2 SEQ_LENGTHS=32 STEPS=1 WARMUP=1 NPROC=1 PROFILE_STEPS=1
#   GRAM_ARGS="--preset tiny --seq-lengths 64 --blocks 0 32 --repeats 1" OUT=/tmp/x bash gpu_campaign.sh
#
# Estimate from the committed H100 runs (results/README.md, gpu-h100-llama3.2-1b-1rank-batch8*):
# an experiment's own wall time is 10-16 s at batch 8 (8 measured + 3 warm-up + 1 counted step of
# 0.3-0.65 s, model build and CUDA start), plus 20-40 s for torchrun, imports and teardown: about
# 1 minute each, 4 minutes for part 1; part 2 times 7 layers x (3 + 4 + 5) blocks x 10 calls at
# about 1-10 ms each plus start-up (about 1 minute); part 3 is one more experiment (about 1
# minute). Norm tuning adds a few seconds to the default row's warm-up. Total: about 6-8 minutes.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHON=${PYTHON:-python3}  # run_all_experiments.sh starts the same interpreter
PARTS=${PARTS:-"suite gram profile"}
MODEL=${MODEL:-llama3.2-1b}
BATCH_SIZE=${BATCH_SIZE:-8}
SEQ_LENGTHS=${SEQ_LENGTHS:-1024}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
PROFILE_STEPS=${PROFILE_STEPS:-2}
GRAM_ARGS=${GRAM_ARGS:-"--seq-lengths 512 1024 2048 --blocks 0 64 128 256 512"}
DRY_RUN=${DRY_RUN:-0}

hardware() {
  local name=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
  fi
  if [ -z "$name" ]; then
    name=$("$PYTHON" -c "import os, torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else f'cpu-{os.cpu_count()}cores')")
  fi
  echo "$name"
}
HW=$(hardware)
if [ -z "$HW" ]; then  # the substitution hides the failure from set -e
  echo "cannot name the hardware: does $PYTHON import torch? (set PYTHON)" >&2
  exit 1
fi
SLUG=$(echo "$HW" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
OUT=${OUT:-"$HERE/results/${SLUG}-campaign"}
NPROC_ARG=()
[ -n "${NPROC:-}" ] && NPROC_ARG=(NPROC="$NPROC")

run() {  # prints the command; runs it unless DRY_RUN=1
  echo "+ $*"
  [ "$DRY_RUN" = 1 ] || env "$@"
}

echo "GPU campaign on: $HW -> $OUT (parts: $PARTS)"
[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"
declare -A SECONDS_OF=()
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    suite)
      run "${NPROC_ARG[@]}" OUT="$OUT/suite" MODEL="$MODEL" BATCH_SIZE="$BATCH_SIZE" \
        SEQ_LENGTHS="$SEQ_LENGTHS" STEPS="$STEPS" WARMUP="$WARMUP" \
        MODES="no_dp ghost_fsdp ghost_fsdp_one_backward ghost_fsdp_one_backward_untuned" \
        bash "$HERE/run_all_experiments.sh" ;;
    gram)
      # shellcheck disable=SC2086
      run PYTHONUNBUFFERED=1 "$PYTHON" "$HERE/gram_blocks.py" $GRAM_ARGS --out "$OUT/gram_blocks" ;;
    profile)
      run "${NPROC_ARG[@]}" OUT="$OUT/op_profile" MODEL="$MODEL" BATCH_SIZE="$BATCH_SIZE" \
        SEQ_LENGTHS="$SEQ_LENGTHS" STEPS="$PROFILE_STEPS" WARMUP="$WARMUP" \
        MODES="ghost_fsdp_one_backward" EXTRA_ARGS="--op-profile" \
        bash "$HERE/run_all_experiments.sh" ;;
    *) echo "PARTS: unknown part '$part' (use suite, gram, profile)"; exit 2 ;;
  esac
  SECONDS_OF[$part]=$((SECONDS - start))
done
[ "$DRY_RUN" = 1 ] && exit 0

{
  echo "# GPU campaign: $HW"
  echo
  "$PYTHON" - <<'PY'
import platform, torch, opacus
cuda = torch.version.cuda or "none"
print(f"torch {torch.__version__} (CUDA {cuda}), opacus {opacus.__version__}, "
      f"Python {platform.python_version()}")
PY
  echo
  echo "Settings: MODEL=$MODEL BATCH_SIZE=$BATCH_SIZE SEQ_LENGTHS=$SEQ_LENGTHS STEPS=$STEPS WARMUP=$WARMUP; gram_blocks.py $GRAM_ARGS"
  echo
  for part in $PARTS; do echo "- $part: ${SECONDS_OF[$part]} s"; done
  echo
  [ -f "$OUT/suite/summary.md" ] && { echo "## Suite"; echo; cat "$OUT/suite/summary.md"; echo; }
  [ -f "$OUT/gram_blocks/gram_blocks.md" ] && { echo "## gram_blocks.py"; echo; cat "$OUT/gram_blocks/gram_blocks.md"; echo; }
  ls "$OUT"/op_profile/profiles/*.ops.txt 2>/dev/null | sed 's/^/op profile: /' || true
} >"$OUT/campaign.md"
echo "campaign summary: $OUT/campaign.md"

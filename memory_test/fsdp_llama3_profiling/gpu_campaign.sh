#!/usr/bin/env bash
# The whole GPU measurement in one command: on one GPU, about 25 minutes at the defaults
# (estimate below); PARTS, SEQ_LENGTHS and STEPS shorten it.
#   1. suite:         the profiling suite's rows with a fixed batch (POISSON=0) at batch 8 and
#                     each of SEQ_LENGTHS: no_dp, upstream ghost_fsdp, the default
#                     (ghost_fsdp_one_backward, tune_norms="auto" = on for GPUs), the default
#                     with tuning off (ghost_fsdp_one_backward_untuned) and the default with
#                     the fused Triton kernels on (ghost_fsdp_one_backward_fused_kernels); each
#                     row's peak memory is in the suite's summary;
#   2. poisson:       the same rows with Poisson sampling (compared per example, as the suite
#                     does: bench/throughput.py) at an expected batch of POISSON_BATCH_SIZE
#                     (default BATCH_SIZE); on a card under 100 GiB each draw runs as physical
#                     batches of at most POISSON_MAX_PHYSICAL (default BATCH_SIZE there, none on
#                     larger cards; 0: none), as BatchMemoryManager runs them, every row alike:
#                     draws reach 1.5x the expected batch, and batch 12 at seq 1024 does not
#                     fit an 80 GB H100; every row, no_dp included, draws the same batches
#                     (--dp-seed POISSON_SEED, a published seed: a benchmark's opt-in, no
#                     privacy claim);
#   3. gram:          gram_blocks.py, the Linear ghost norms of one decoder block per gram_block;
#   4. ledger:        the op ledger (bench/ledger.py) of the same model at the first sequence
#                     length, one decoder block, on this machine's CPU: bytes, ops and FLOPs per
#                     phase beside the timings;
#   5. profile:       a torch.profiler per-op table and Chrome trace (gzipped) of one non-private
#                     and one default step, and their time per phase and op class
#                     (bench/trace_phases.py: op_profile/phases.md);
#   6. rows:          row_kernels_bench.py, the row kernels (coefficient scaling, Gram dots)
#                     against the torch ops they replace, and a launch's host time;
#   7. noise:         noise_kernel_bench.py, the noise kernel against torch's draw and add on the
#                     local gradients of Llama-3.2-1B, and a call's host time;
#   8. hf_fsdp:       examples/hf_sft.py through accelerate's FSDP2 plugin (DPSFTTrainer, 20
#                     steps), the integration path CPU tests cannot take (on CPU accelerate
#                     wraps DDP instead); its summary line lands in hf_fsdp/summary.json.
# A part that fails is reported and the next part runs; the script exits 1 at the end if any did.
# Results go to results/<hardware>-campaign/ (hardware from nvidia-smi, else torch), with
# campaign.md naming the hardware, software, commands and each part's wall time.
# Environment overrides: PYTHON (default python3; the suite's scripts start it too), OUT, PARTS
# ("suite poisson gram ledger profile rows noise hf_fsdp"), MODEL, BATCH_SIZE, SEQ_LENGTHS ("1024 2048 4096"),
# POISSON_BATCH_SIZE, POISSON_MAX_PHYSICAL, POISSON_SEED (2026), MODES, STEPS, WARMUP, NPROC, GRAM_ARGS, LEDGER_ARGS, PROFILE_STEPS,
# DRY_RUN=1 (print the commands only).
# CPU smoke test: MODEL=tiny BATCH_SIZE=2 SEQ_LENGTHS=32 STEPS=1 WARMUP=1 NPROC=1 PROFILE_STEPS=1
#   PARTS="suite gram profile"
#   GRAM_ARGS="--preset tiny --seq-lengths 64 --blocks 0 32 --repeats 1" OUT=/tmp/x bash gpu_campaign.sh
#
# Estimate from the committed H100 and H200 runs: an experiment is about 1 minute at batch 8 and
# seq 1024 (start-up, 3 warm-up and 8 measured steps), about 1.5 and 3 minutes at 2048 and 4096:
# 5 modes x 5.5 minutes for each of suite and poisson (about 11 minutes each); gram about
# 1 minute; the ledger 2-4 minutes; the profile about 1 minute. Memory: at seq 4096 and batch 8
# the non-private Llama-3.2-1B step alone needs about 4x the activations of seq 1024 (49.8 GB
# there on an H200); on an 80 GB card run SEQ_LENGTHS="1024 2048" or BATCH_SIZE=4 for 4096.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHON=${PYTHON:-python3}  # run_all_experiments.sh starts the same interpreter
PARTS=${PARTS:-"suite poisson gram ledger profile rows noise hf_fsdp"}
MODEL=${MODEL:-llama3.2-1b}
BATCH_SIZE=${BATCH_SIZE:-8}
SEQ_LENGTHS=${SEQ_LENGTHS:-"1024 2048 4096"}
MODES=${MODES:-"no_dp ghost_fsdp ghost_fsdp_one_backward ghost_fsdp_one_backward_untuned ghost_fsdp_one_backward_fused_kernels"}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
POISSON_SEED=${POISSON_SEED:-2026}
PROFILE_STEPS=${PROFILE_STEPS:-2}
GRAM_ARGS=${GRAM_ARGS:-"--seq-lengths 512 1024 2048 4096 --blocks 0 64 128 256 512"}
FIRST_SEQ=${SEQ_LENGTHS%% *}
LEDGER_ARGS=${LEDGER_ARGS:-"--preset $MODEL --blocks 1 --batch-size 1 --seq-length $FIRST_SEQ --accelerator-norms"}
DRY_RUN=${DRY_RUN:-0}

gpu_mib() {  # the first GPU's memory in MiB, 0 when none answers
  local mib=""
  command -v nvidia-smi >/dev/null 2>&1 &&
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 || true)
  echo "${mib:-0}" | tr -dc '0-9'
}
POISSON_BATCH_SIZE=${POISSON_BATCH_SIZE:-$BATCH_SIZE}
if [ -z "${POISSON_MAX_PHYSICAL:-}" ]; then
  POISSON_MAX_PHYSICAL=0
  mib=$(gpu_mib)
  if [ "${mib:-0}" -gt 0 ] && [ "$mib" -lt 102400 ]; then
    POISSON_MAX_PHYSICAL=$BATCH_SIZE
    echo "Poisson rows in physical batches of at most $POISSON_MAX_PHYSICAL: a $mib MiB card does not hold 1.5x $POISSON_BATCH_SIZE"
  fi
fi
POISSON_ARGS="--dp-seed $POISSON_SEED"
[ "$POISSON_MAX_PHYSICAL" -gt 0 ] && POISSON_ARGS+=" --max-physical-batch-size $POISSON_MAX_PHYSICAL"

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
FAILED=()
run_part() {  # one part; its status is its last command's
  local part=$1 batch
  case "$part" in
    suite|poisson)
      batch=$BATCH_SIZE; [ "$part" = poisson ] && batch=$POISSON_BATCH_SIZE
      run "${NPROC_ARG[@]}" OUT="$OUT/$part" MODEL="$MODEL" BATCH_SIZE="$batch" \
        SEQ_LENGTHS="$SEQ_LENGTHS" STEPS="$STEPS" WARMUP="$WARMUP" MODES="$MODES" \
        POISSON="$([ "$part" = poisson ] && echo 1 || echo 0)" \
        EXTRA_ARGS="${EXTRA_ARGS:-}$([ "$part" = poisson ] && echo " $POISSON_ARGS")" \
        bash "$HERE/run_all_experiments.sh" ;;
    gram)
      # shellcheck disable=SC2086
      run PYTHONUNBUFFERED=1 "$PYTHON" "$HERE/gram_blocks.py" $GRAM_ARGS --out "$OUT/gram_blocks" ;;
    ledger)
      # shellcheck disable=SC2086
      run PYTHONUNBUFFERED=1 "$PYTHON" -m opacus_fsdp_sync.bench.ledger $LEDGER_ARGS \
        --out "$OUT/ledger" ;;
    profile)
      run "${NPROC_ARG[@]}" OUT="$OUT/op_profile" MODEL="$MODEL" BATCH_SIZE="$BATCH_SIZE" \
        SEQ_LENGTHS="$FIRST_SEQ" STEPS="$PROFILE_STEPS" WARMUP="$WARMUP" \
        MODES="no_dp ghost_fsdp_one_backward" EXTRA_ARGS="--op-profile" POISSON=0 \
        bash "$HERE/run_all_experiments.sh" &&
        run PYTHONUNBUFFERED=1 "$PYTHON" -m opacus_fsdp_sync.bench.trace_phases \
          "$OUT/op_profile/profiles/no_dp_seq${FIRST_SEQ}.trace.json" \
          "$OUT/op_profile/profiles/ghost_fsdp_one_backward_seq${FIRST_SEQ}.trace.json" \
          --out "$OUT/op_profile/phases.md" &&
        { [ "$DRY_RUN" = 1 ] || gzip -f "$OUT"/op_profile/profiles/*.trace.json; } ;;
    rows)
      echo "+ $PYTHON $HERE/row_kernels_bench.py > $OUT/rows_bench.txt"
      [ "$DRY_RUN" = 1 ] || PYTHONUNBUFFERED=1 "$PYTHON" "$HERE/row_kernels_bench.py" >"$OUT/rows_bench.txt" ;;
    noise)
      echo "+ $PYTHON $HERE/noise_kernel_bench.py > $OUT/noise_bench.txt"
      [ "$DRY_RUN" = 1 ] || PYTHONUNBUFFERED=1 "$PYTHON" "$HERE/noise_kernel_bench.py" >"$OUT/noise_bench.txt" ;;
    hf_fsdp)
      cmd=(env PYTHONUNBUFFERED=1 "$PYTHON" -m torch.distributed.run --standalone
        --nproc-per-node "${NPROC:-1}" "$HERE/../../examples/hf_sft.py" --fsdp --max-steps 20
        --out "$OUT/hf_fsdp/run")
      echo "+ ${cmd[*]}"
      if [ "$DRY_RUN" != 1 ]; then
        mkdir -p "$OUT/hf_fsdp"
        "${cmd[@]}" | tee "$OUT/hf_fsdp/log.txt" | tail -n 1 >"$OUT/hf_fsdp/summary.json"
      fi ;;
  esac
}
for part in $PARTS; do
  case "$part" in
    suite|poisson|gram|ledger|profile|rows|noise|hf_fsdp) ;;
    *) echo "PARTS: unknown part '$part' (use suite, poisson, gram, ledger, profile, rows, noise, hf_fsdp)"
       exit 2 ;;
  esac
done
for part in $PARTS; do
  start=$SECONDS
  if ! run_part "$part"; then
    FAILED+=("$part")
    echo "part $part FAILED (its logs are under $OUT); going on with the next part"
  fi
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
  echo "Settings: MODEL=$MODEL BATCH_SIZE=$BATCH_SIZE POISSON_BATCH_SIZE=$POISSON_BATCH_SIZE POISSON_MAX_PHYSICAL=$POISSON_MAX_PHYSICAL SEQ_LENGTHS=$SEQ_LENGTHS STEPS=$STEPS WARMUP=$WARMUP; gram_blocks.py $GRAM_ARGS"
  echo
  for part in $PARTS; do
    status=""; [[ " ${FAILED[*]+"${FAILED[*]}"} " == *" $part "* ]] && status=" (FAILED: see its logs)"
    echo "- $part: ${SECONDS_OF[$part]} s$status"
  done
  echo
  [ -f "$OUT/suite/summary.md" ] && { echo "## Suite, fixed batch"; echo; cat "$OUT/suite/summary.md"; echo; }
  [ -f "$OUT/poisson/summary.md" ] && { echo "## Suite, Poisson sampling"; echo; cat "$OUT/poisson/summary.md"; echo; }
  [ -f "$OUT/gram_blocks/gram_blocks.md" ] && { echo "## gram_blocks.py"; echo; cat "$OUT/gram_blocks/gram_blocks.md"; echo; }
  [ -f "$OUT/hf_fsdp/summary.json" ] && { echo "## DPSFTTrainer, accelerate's FSDP2 plugin"; echo; cat "$OUT/hf_fsdp/summary.json"; echo; }
  [ -f "$OUT/rows_bench.txt" ] && { echo "## Row kernels against torch"; echo; sed 's/^/    /' "$OUT/rows_bench.txt"; echo; }
  [ -f "$OUT/noise_bench.txt" ] && { echo "## Noise kernel against torch"; echo; sed 's/^/    /' "$OUT/noise_bench.txt"; echo; }
  [ -f "$OUT/op_profile/phases.md" ] && { echo "## Op profile by phase"; echo; cat "$OUT/op_profile/phases.md"; echo; }
  for f in "$OUT"/ledger/*.md; do [ -f "$f" ] && { echo "## Op ledger"; echo; cat "$f"; echo; }; done
  ls "$OUT"/op_profile/profiles/*.ops.txt 2>/dev/null | sed 's/^/op profile: /' || true
} >"$OUT/campaign.md"
echo "campaign summary: $OUT/campaign.md"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "failed parts: ${FAILED[*]+"${FAILED[*]}"}" >&2
  exit 1
fi

#!/usr/bin/env bash
# Profiling suite: every (mode, sequence length) in a fresh torchrun process, then a summary table
# (Markdown + CSV) and plots. Environment overrides (defaults depend on whether a GPU is present):
#   NPROC, MODEL, TASK, MODES, SEQ_LENGTHS, BATCH_SIZE, STEPS, WARMUP, OUT, MODEL_PATH, EXTRA_ARGS,
#   TIE_VARIANTS ("preset", or any of "tied untied": the same model with the embedding and head
#   tied or untied, to report the cost of the tied weight's cross term),
#   FSDP_APIS (any of "fsdp2 fsdp1 ddp"; default fsdp2), STRATEGY, WRAP_POLICY,
#   POISSON (1, default: private modes draw batches by Poisson sampling, as the accounting
#   assumes; 0: one fixed batch every step, for fixed-shape benchmarking),
#   BIND_CPUS (1, default: on CPU each rank runs on its own block of the cores, as MPI
#   launchers and run_cpu bind ranks; 0: the ranks are left to the scheduler).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python3}

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" -gt 0 ]; then
  NPROC=${NPROC:-$GPUS}; MODEL=${MODEL:-llama3.2-1b}; SEQ_LENGTHS=${SEQ_LENGTHS:-1024}
  BATCH_SIZE=${BATCH_SIZE:-2}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}
else
  NPROC=${NPROC:-2}; MODEL=${MODEL:-small}; SEQ_LENGTHS=${SEQ_LENGTHS:-"64 128"}
  BATCH_SIZE=${BATCH_SIZE:-4}; STEPS=${STEPS:-5}; WARMUP=${WARMUP:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
fi
TASK=${TASK:-causal_lm}
MODES=${MODES:-"no_dp ghost_fsdp ghost_fsdp_sync ghost_fsdp_keep ghost_fsdp_restricted ghost_fsdp_parity ghost_fsdp_one_backward_ghost_norms ghost_fsdp_one_backward"}
TIE_VARIANTS=${TIE_VARIANTS:-preset}
FSDP_APIS=${FSDP_APIS:-fsdp2}
STRATEGY=${STRATEGY:-full}
WRAP_POLICY=${WRAP_POLICY:-transformer}
OUT=${OUT:-"$HERE/runs/$(date +%Y%m%d-%H%M%S)"}
MODEL_PATH=${MODEL_PATH:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
POISSON=${POISSON:-1}
BIND_CPUS=${BIND_CPUS:-1}
mkdir -p "$OUT/logs"

total=0
for seq in $SEQ_LENGTHS; do for tie in $TIE_VARIANTS; do for api in $FSDP_APIS; do
  for mode in $MODES; do total=$((total + 1)); done; done; done; done
echo "Profiling suite: model=$MODEL task=$TASK nproc=$NPROC gpus=$GPUS apis=[$FSDP_APIS] modes=[$MODES] seq=[$SEQ_LENGTHS] batch=$BATCH_SIZE steps=$STEPS warmup=$WARMUP sampling=$([ "$POISSON" = 0 ] && echo fixed || echo poisson)$([ "$GPUS" = 0 ] && { [ "$BIND_CPUS" = 0 ] && echo " cpus=unbound" || echo " cpus=bound per rank"; })"
echo "Results: $OUT"

i=0; failed=()
for seq in $SEQ_LENGTHS; do
 for tie in $TIE_VARIANTS; do
  case "$tie" in
    preset) suffix=""; tie_args=() ;;
    tied) suffix="_tied"; tie_args=(--tie-word-embeddings) ;;
    untied) suffix="_untied"; tie_args=(--no-tie-word-embeddings) ;;
    *) echo "TIE_VARIANTS: unknown variant '$tie' (use preset, tied, untied)"; exit 2 ;;
  esac
  for api in $FSDP_APIS; do
  api_suffix=""; [ "$api" != "fsdp2" ] && api_suffix="_${api}"
  for mode in $MODES; do
    i=$((i + 1)); name="${mode}_seq${seq}${suffix}${api_suffix}"
    echo "experiment $i/$total: $name"
    args=(--model "$MODEL" --task "$TASK" --mode "$mode" --seq-length "$seq"
          --batch-size "$BATCH_SIZE" --steps "$STEPS" --warmup "$WARMUP" --out "$OUT" --name "$name"
          --fsdp-api "$api" --strategy "$STRATEGY" --wrap-policy "$WRAP_POLICY" "${tie_args[@]}")
    [ -n "$MODEL_PATH" ] && args+=(--model-path "$MODEL_PATH")
    [ "$POISSON" = 0 ] && args+=(--no-poisson-sampling)
    [ "$BIND_CPUS" = 0 ] && args+=(--no-bind-cpus)
    # shellcheck disable=SC2206
    [ -n "$EXTRA_ARGS" ] && args+=($EXTRA_ARGS)
    if ! "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        "$HERE/profile_experiment.py" "${args[@]}" >"$OUT/logs/$name.log" 2>&1 \
        || [ ! -f "$OUT/$name.json" ]; then
      echo "  FAILED: $name (log: $OUT/logs/$name.log)"; tail -n 5 "$OUT/logs/$name.log" | sed 's/^/    /'
      printf '{"config": {"mode": "%s", "seq_length": %s, "name": "%s", "fsdp_api": "%s"}, "status": "failed"}\n' \
        "$mode" "$seq" "$name" "$api" >"$OUT/$name.json"
      failed+=("$name")
    else
      grep -E "^\[Ghost\] $name:" "$OUT/logs/$name.log" | sed 's/^/  /' || true
    fi
  done
  done
 done
done

"$PYTHON" "$HERE/summarize.py" "$OUT"
"$PYTHON" "$HERE/plot_results.py" "$OUT" || echo "plots skipped (install the 'plot' extra: pip install -e .[plot])"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed experiments (${#failed[@]}/$total): ${failed[*]}"; exit 1
fi
echo "all $total experiments succeeded"

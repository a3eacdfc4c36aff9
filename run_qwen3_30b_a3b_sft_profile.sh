#!/usr/bin/env bash
# Profile SFT steps of Qwen3-30B-A3B (or any config): one torchrun trial per (profile step, kind).
#
#   bash run_qwen3_30b_a3b_sft_profile.sh [key=value ...]      # extra config overrides for every trial
#
# Environment variables (see README.md; config-mapped ones override the YAML only when set):
#   CONFIG (qwen3_30b_a3b_sft_profile.yaml; or a preset name such as tiny_cpu), MODEL_PATH, FILEROOT,
#   EXPERIMENT_NAME, PROFILE_STEPS=0,1, TOTAL_STEPS (unset: step+1), PROFILE_RANKS (unset: rank 0 of
#   each PP stage; empty: all; 0,2-4), PROFILE_KINDS=kernel,memory, N_GPUS_PER_NODE (unset: world
#   size / N_NODES), N_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, PROFILE_FAKE_SEQ_LEN,
#   PROFILE_FAKE_DATASET_SIZE, PROFILE_FAKE_LOSS_START_RATIO, TRAIN_BATCH_SIZE, PROFILE_N_MBS,
#   MEMORY_MAX_ENTRIES, LOGPROBS_CHUNK_SIZE, LM_HEAD_LOSS_CHUNK_SIZE, USE_PRECISION_AWARE_OPTIMIZER,
#   MAIN_GRADS_DTYPE, USE_DETERMINISTIC_ALGORITHMS, STOP_ON_FAILURE=1, RUN_ROOT, PROFILE_STAMP.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # torchrun's own default, stated so it does not warn

# 1. Validate everything and write RUN_ROOT/{profile_settings.log,trials.tsv} before launching anything.
plan_out="$("$PYTHON" -m sftprof.launch plan "$@")" || exit $?
eval "$plan_out"   # RUN_ROOT, STOP_ON_FAILURE, NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
summary="$RUN_ROOT/summary.tsv"
printf 'trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\trun_dir\tlog_dir\n' > "$summary"
echo "sftprof: run root $RUN_ROOT (settings in profile_settings.log)"

final_rc=0
while IFS=$'\t' read -r -u 3 trial kind step run_dir log_dir args_file; do   # fd 3: children keep stdin
  mapfile -t train_args < "$args_file"
  echo "sftprof: trial $trial (kind=$kind step=$step)"
  smi_pid=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total \
      --format=csv,nounits -lms 500 > "$run_dir/nvidia_smi.csv" 2>/dev/null &
    smi_pid=$!
  fi
  start=$(date +%s)
  "$PYTHON" -m torch.distributed.run --nproc_per_node="$NPROC_PER_NODE" --nnodes="$NNODES" --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    "$HERE/train_sft_profile.py" "${train_args[@]}" 2>&1 | tee "$run_dir/launcher.log"
  torchrun_rc=${PIPESTATUS[0]}
  elapsed=$(( $(date +%s) - start ))
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null && wait "$smi_pid" 2>/dev/null
  if [ "$NODE_RANK" = "0" ]; then
    # Success is the trainer's completion record (written by global rank 0), not a log grep.
    train_rc=$("$PYTHON" -m sftprof.launch status "$log_dir")
    [ "$torchrun_rc" -ne 0 ] && train_rc=$torchrun_rc
    pp_args=(--log-dir "$log_dir" --run-dir "$run_dir" --profile-kind "$kind" --profile-step "$step"
             --trainer-log "$log_dir/trainer.log")
    [ -s "$run_dir/nvidia_smi.csv" ] && pp_args+=(--nvidia-smi-csv "$run_dir/nvidia_smi.csv")
    "$PYTHON" "$HERE/postprocess_profile.py" "${pp_args[@]}" 2>&1 | tee -a "$run_dir/launcher.log"
    pp_rc=${PIPESTATUS[0]}
  else
    # Other nodes: torchrun's exit status; node 0 postprocesses every rank from the shared FILEROOT.
    train_rc=$torchrun_rc
    pp_rc=0
  fi
  status=$train_rc
  [ "$status" -eq 0 ] && status=$pp_rc
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$trial" "$kind" "$step" "$status" "$train_rc" "$pp_rc" \
    "$elapsed" "$run_dir" "$log_dir" >> "$summary"
  if [ "$status" -ne 0 ]; then
    final_rc=$status
    echo "sftprof: trial $trial FAILED (status $status; logs in $run_dir/launcher.log and $log_dir)" >&2
    if [ "$STOP_ON_FAILURE" = "1" ]; then
      echo "sftprof: STOP_ON_FAILURE=1: stopping after the first failure" >&2
      break
    fi
  fi
done 3< "$RUN_ROOT/trials.tsv"

column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
exit "$final_rc"

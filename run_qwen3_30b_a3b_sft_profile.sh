#!/usr/bin/env bash
# Profile SFT steps of Qwen3-30B-A3B (or any config): one torchrun trial per (profile step, kind).
#
#   [VAR=value ...] bash run_qwen3_30b_a3b_sft_profile.sh [key=value ...]   # overrides for every trial
#   bash run_qwen3_30b_a3b_sft_profile.sh --help                           # variables, defaults, examples
#
# The variables and their defaults live in sftprof/launch.py (DRIVER_VARS) and README.md.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # torchrun's own default, stated so it does not warn
export PYTHONUNBUFFERED=1                         # progress lines as they happen, not at exit
# Triton autotuning results kept on disk (TRITON_CACHE_DIR, default ~/.triton/cache), so each trial after the first
# reuses them instead of re-timing every config at step 0 (fla's Gated DeltaNet kernels, sftprof/ops' row kernels).
export TRITON_CACHE_AUTOTUNING="${TRITON_CACHE_AUTOTUNING:-1}"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "sftprof: PYTHON=$PYTHON: not an executable on PATH; accepted: a Python interpreter with sftprof's requirements (default python3)" >&2
  exit 2
fi
# A Python with sftprof's requirements (sftprof/pycheck.py prints "ok" or what is missing); /bin/true prints nothing.
py_check="$("$PYTHON" -m sftprof.pycheck 2>&1 | tail -n 1)"
case "$py_check" in
  ok) ;;
  "Python "*|"cannot import "*) py_problem="$py_check" ;;
  "") py_problem="not a Python interpreter (\`$PYTHON -m sftprof.pycheck\` printed nothing)" ;;
  *) py_problem="not a Python interpreter that runs sftprof (\`$PYTHON -m sftprof.pycheck\` printed: $py_check)" ;;
esac
if [ "$py_check" != ok ]; then
  echo "sftprof: PYTHON=$PYTHON: $py_problem; accepted: a Python interpreter with sftprof's requirements (default python3)" >&2
  exit 2
fi
for arg in "$@"; do
  case "$arg" in
    -h|--help) exec "$PYTHON" -m sftprof.launch usage ;;
    -*) echo "sftprof: unknown option $arg; accepted: -h/--help, otherwise key=value config overrides (and driver variables in the environment): bash $0 --help" >&2
        exit 2 ;;
  esac
done

# Ctrl-C / SIGTERM stop the whole run (set before the plan, so that a signal during it stops it as well): during the
# plan, the plan gets SIGTERM and removes what it wrote (sftprof/launch.py, remove_plan); later, the running torchrun
# gets SIGTERM (it stops its workers), the trial is recorded as interrupted (also when the signal comes while it is
# postprocessed), the trials after it as not run, and the driver exits 128 + the signal (130 for SIGINT).
# The plan and torchrun run in the background so that the trap runs at once, not when they end.
interrupted=0
signal_name=""
planning=1
plan_pid=""
torch_pid=""
on_signal() {
  interrupted=$1
  signal_name=$2
  if [ "$planning" = 1 ]; then   # the plan's end says what it removed: one line, below
    [ -n "$plan_pid" ] && kill -TERM "$plan_pid" 2>/dev/null
    return
  fi
  echo "sftprof: $2 received: stopping the run" >&2
  [ -n "$torch_pid" ] && kill -TERM "$torch_pid" 2>/dev/null
}
trap 'on_signal 130 SIGINT' INT
trap 'on_signal 143 SIGTERM' TERM
fifo_dir="$(mktemp -d)"
trap 'rm -rf "$fifo_dir"' EXIT

# 1. Validate everything and write RUN_ROOT/{profile_settings.log,trials.tsv} before launching anything.
"$PYTHON" -m sftprof.launch plan "$@" > "$fifo_dir/plan_out" &
plan_pid=$!
[ "$interrupted" != 0 ] && kill -TERM "$plan_pid" 2>/dev/null   # a signal between the trap and $!
wait "$plan_pid"
plan_rc=$?
while [ "$interrupted" != 0 ] && kill -0 "$plan_pid" 2>/dev/null; do   # the trap ended the wait, not the plan
  wait "$plan_pid"
  plan_rc=$?
done
planning=0
plan_out="$(cat "$fifo_dir/plan_out")"
# What the plan printed tells how it ended (its status may be the interrupted wait's): interrupted, with what it
# removed (PLAN_INTERRUPTED=...); complete (its variables, RUN_ROOT=... among them); or neither (nothing written).
stopped="$(printf '%s\n' "$plan_out" | sed -n 's/^PLAN_INTERRUPTED=//p' | tail -n 1)"
if [ -n "$stopped" ]; then
  eval "stopped=$stopped"   # the plan's shlex-quoted words
elif ! printf '%s\n' "$plan_out" | grep -q '^RUN_ROOT='; then
  stopped="nothing was written"   # the plan ended before it wrote anything (a signal before its handler, bad input)
fi
if [ "$interrupted" != 0 ] && [ -n "$stopped" ]; then
  echo "sftprof: $signal_name received during the plan: nothing was launched; $stopped" >&2
  exit "$interrupted"
fi
if [ "$plan_rc" = 130 ] || [ "$plan_rc" = 143 ] && [ -n "$stopped" ]; then   # the plan signalled, not the driver
  echo "sftprof: the plan got signal $(( plan_rc - 128 )) (not the driver): nothing was launched; $stopped" >&2
  exit "$plan_rc"
fi
[ "$plan_rc" -ne 0 ] && [ "$interrupted" = 0 ] && exit "$plan_rc"
# RUN_ROOT STOP_ON_FAILURE TRIALS NODE_TIMEOUT NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT, and the
# artifact names (sftprof/artifacts.py): TRIALS_TSV SUMMARY_TSV LAUNCHER_LOG NVIDIA_SMI_CSV TRAINER_LOG, and the
# summary.tsv status of an interrupted trial: INTERRUPTED_STATUS
eval "$plan_out"
if [ -z "${RUN_ROOT:-}" ]; then   # the plan exited 0 without its variables (cannot happen with a working PYTHON)
  echo "sftprof: PYTHON=$PYTHON: \`$PYTHON -m sftprof.launch plan\` printed no plan; accepted: a Python interpreter with sftprof's requirements (default python3)" >&2
  exit 2
fi
summary="$RUN_ROOT/$SUMMARY_TSV"
printf 'trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\trun_dir\tlog_dir\n' > "$summary"
echo "sftprof: run root $RUN_ROOT (settings in profile_settings.log)"
# a signal after the plan was complete, before the first trial: no trial starts (the loop's first check)
[ "$interrupted" != 0 ] && echo "sftprof: $signal_name received: stopping the run" >&2

final_rc=0
n=0
run_start=$(date +%s)
# torchrun runs in the background (the traps above run at once, not when the trial ends); its output goes through
# a FIFO to tee (launcher.log), which the driver waits for before appending to that log.
mkfifo "$fifo_dir/torchrun_out"
while IFS=$'\t' read -r -u 3 trial kind step run_dir log_dir args_file; do   # fd 3: children keep stdin
  [ "$interrupted" != 0 ] && break   # a signal between two trials: the next one does not start
  n=$((n + 1))
  mapfile -t train_args < "$args_file"
  echo "sftprof: [$n/$TRIALS] trial $trial (kind=$kind step=$step) started $(date +%H:%M:%S)"
  smi_pid=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total \
      --format=csv,nounits -lms 500 > "$run_dir/$NVIDIA_SMI_CSV" 2>/dev/null &
    smi_pid=$!
  fi
  start=$(date +%s)
  tee "$run_dir/$LAUNCHER_LOG" < "$fifo_dir/torchrun_out" &
  tee_pid=$!
  # --rdzv-conf timeout: how long a node waits for the others to join (static rendezvous).
  "$PYTHON" -m torch.distributed.run --nproc_per_node="$NPROC_PER_NODE" --nnodes="$NNODES" --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --rdzv-conf "timeout=$NODE_TIMEOUT" \
    "$HERE/train_sft_profile.py" "${train_args[@]}" > "$fifo_dir/torchrun_out" 2>&1 &
  torch_pid=$!
  [ "$interrupted" != 0 ] && kill -TERM "$torch_pid" 2>/dev/null   # a signal between the trap and $!
  wait "$torch_pid"
  torchrun_rc=$?
  while [ "$interrupted" != 0 ] && kill -0 "$torch_pid" 2>/dev/null; do   # the trap ended the wait, not torchrun
    wait "$torch_pid"
    torchrun_rc=$?
  done
  torch_pid=""
  wait "$tee_pid"
  elapsed=$(( $(date +%s) - start ))
  # torchrun signalled but not the driver (Ctrl-C to a driver started in the background, where SIGINT is ignored
  # and cannot be trapped; a kill of torchrun): the run stops as after the driver's own trap
  if [ "$interrupted" = 0 ] && [ "$torchrun_rc" -ne 0 ]; then
    sig=$(grep -aoE 'SignalException: Process [0-9]+ got signal: [0-9]+' "$run_dir/$LAUNCHER_LOG" | tail -n 1)
    if [ -n "$sig" ]; then
      interrupted=$(( 128 + ${sig##* } ))
      echo "sftprof: torchrun got signal ${sig##* } (not the driver): stopping the run" >&2
    fi
  fi
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null && wait "$smi_pid" 2>/dev/null
  if [ "$NNODES" -gt 1 ]; then
    "$PYTHON" -m sftprof.launch node-record "$log_dir" "$NODE_RANK" "$torchrun_rc" "$elapsed" "$NNODES" "$NPROC_PER_NODE"
  fi
  if [ "$interrupted" != 0 ]; then   # neither the other nodes' records nor postprocessing are waited for
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$trial" "$kind" "$step" "$INTERRUPTED_STATUS" "$torchrun_rc" "-" \
      "$elapsed" "$run_dir" "$log_dir" >> "$summary"
    echo "sftprof: [$n/$TRIALS] trial $trial interrupted after $elapsed s (torchrun status $torchrun_rc); $(( TRIALS - n )) trial(s) will not run" >&2
    break
  fi
  if [ "$NODE_RANK" = "0" ]; then
    # Success is the trainer's completion record (written by global rank 0), not a log grep.
    train_rc=$("$PYTHON" -m sftprof.launch status "$log_dir")
    [ "$torchrun_rc" -ne 0 ] && train_rc=$torchrun_rc
    if [ "$NNODES" -gt 1 ]; then   # every other node's end record, each failure named
      "$PYTHON" -m sftprof.launch wait-nodes "$log_dir" "$NNODES" "$NODE_TIMEOUT" 2>&1 | tee -a "$run_dir/$LAUNCHER_LOG"
      nodes_rc=${PIPESTATUS[0]}
      [ "$train_rc" -eq 0 ] && train_rc=$nodes_rc
    fi
    pp_rc="-"
    if [ "$interrupted" = 0 ]; then   # a signal while the trial's status was read: not postprocessed
      echo "sftprof: [$n/$TRIALS] postprocessing $trial"
      pp_args=(--log-dir "$log_dir" --run-dir "$run_dir" --profile-kind "$kind" --profile-step "$step"
               --trainer-log "$log_dir/$TRAINER_LOG")
      [ -s "$run_dir/$NVIDIA_SMI_CSV" ] && pp_args+=(--nvidia-smi-csv "$run_dir/$NVIDIA_SMI_CSV")
      "$PYTHON" "$HERE/postprocess_profile.py" "${pp_args[@]}" 2>&1 | tee -a "$run_dir/$LAUNCHER_LOG"
      pp_rc=${PIPESTATUS[0]}
      # postprocessing stopped by a SIGINT/SIGTERM that the driver did not get (a kill of it): the run stops as after
      # the driver's own trap
      if [ "$interrupted" = 0 ] && { [ "$pp_rc" = 130 ] || [ "$pp_rc" = 143 ]; }; then
        interrupted=$pp_rc
        echo "sftprof: postprocessing got signal $(( pp_rc - 128 )) (not the driver): stopping the run" >&2
      fi
    fi
  else
    # Other nodes: torchrun's exit status; node 0 postprocesses every rank from the shared FILEROOT.
    train_rc=$torchrun_rc
    pp_rc=0
  fi
  if [ "$interrupted" != 0 ]; then   # the signal came after training: while postprocessing or reading the status
    # postprocessing that ended with 0 was not interrupted (the signal reached the driver alone, which waited for it)
    status=$INTERRUPTED_STATUS
    [ "$pp_rc" = 0 ] && status=$train_rc
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$trial" "$kind" "$step" "$status" "$train_rc" "$pp_rc" \
      "$elapsed" "$run_dir" "$log_dir" >> "$summary"
    if [ "$status" = "$INTERRUPTED_STATUS" ]; then
      echo "sftprof: [$n/$TRIALS] trial $trial interrupted after training (train status $train_rc, postprocess status $pp_rc); $(( TRIALS - n )) trial(s) will not run" >&2
    else
      echo "sftprof: [$n/$TRIALS] trial $trial postprocessed (status $status) before the signal stopped the run; $(( TRIALS - n )) trial(s) will not run" >&2
    fi
    break
  fi
  status=$train_rc
  [ "$status" -eq 0 ] && status=$pp_rc
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$trial" "$kind" "$step" "$status" "$train_rc" "$pp_rc" \
    "$elapsed" "$run_dir" "$log_dir" >> "$summary"
  done_s=$(( $(date +%s) - run_start ))
  left=$(( TRIALS - n ))
  stopping=0
  [ "$status" -ne 0 ] && [ "$STOP_ON_FAILURE" = "1" ] && stopping=1
  if [ "$left" -eq 0 ]; then
    echo "sftprof: [$n/$TRIALS] done in $(( $(date +%s) - start )) s (status $status); all trials took $done_s s"
  elif [ "$stopping" = "1" ]; then
    echo "sftprof: [$n/$TRIALS] done in $(( $(date +%s) - start )) s (status $status); $left trial(s) will not run"
  else
    echo "sftprof: [$n/$TRIALS] done in $(( $(date +%s) - start )) s (status $status); about $(( done_s * left / n )) s more for $left trial(s)"
  fi
  if [ "$status" -ne 0 ]; then
    final_rc=$status
    echo "sftprof: trial $trial FAILED (status $status; logs in $run_dir/$LAUNCHER_LOG and $log_dir)" >&2
    if [ "$stopping" = "1" ]; then
      echo "sftprof: STOP_ON_FAILURE=1: stopping after the first failure" >&2
      break
    fi
  fi
done 3< "$RUN_ROOT/$TRIALS_TSV"
# The rest of the run is not interrupted again: the not-run rows and the end table are written in any case.
trap '' INT TERM
# A row for each planned trial that did not run (STOP_ON_FAILURE, an interrupt), so summary.tsv has one row per trial.
"$PYTHON" -m sftprof.launch not-run "$RUN_ROOT"

echo
"$PYTHON" -m sftprof.launch report "$RUN_ROOT" --node-rank "$NODE_RANK" --python "$PYTHON"
[ "$interrupted" != 0 ] && exit "$interrupted"
exit "$final_rc"

#!/usr/bin/env bash
# Profile SFT steps of Qwen3-30B-A3B (or any config): one torchrun trial per (profile step, kind).
#
#   [VAR=value ...] bash run_qwen3_30b_a3b_sft_profile.sh [key=value ...]   # overrides for every trial
#   bash run_qwen3_30b_a3b_sft_profile.sh --help                           # variables, defaults, examples
#
# This entry checks that PYTHON can run sftprof, then becomes the Python launcher (sftprof/launch/, its variables in
# sftprof/launch/variables.py): it plans, runs the trials, handles Ctrl-C / SIGTERM and prints the end table.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHON="${PYTHON:-python3}" PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"
accepted="accepted: a Python interpreter with sftprof's requirements (default python3)"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "sftprof: PYTHON=$PYTHON: not an executable on PATH; $accepted" >&2
  exit 2
fi
# sftprof/pycheck.py prints "ok" or what is missing (old Python, modules, versions in range); /bin/true prints nothing
check="$("$PYTHON" -m sftprof.pycheck 2>&1 | tail -n 1)"
case "$check" in
  ok) exec "$PYTHON" -m sftprof.launch run "$@" ;;
  "Python "*|"cannot import "*|"megatron-core "*|"cannot read megatron-core"*|"untested versions: "*) ;;
  "") check="not a Python interpreter (\`$PYTHON -m sftprof.pycheck\` printed nothing)" ;;
  *) check="not a Python interpreter that runs sftprof (\`$PYTHON -m sftprof.pycheck\` printed: $check)" ;;
esac
echo "sftprof: PYTHON=$PYTHON: $check; $accepted" >&2
exit 2

#!/usr/bin/env bash
# Regenerate docs/examples/ from real runs on one GPU (an H200 with Transformer Engine, and fla for Qwen3.5):
#   qwen3_30b_a3b/               the shipped YAML cut to 4 layers at 131072 tokens, megatron:d1, 3 steps, step 2
#                                profiled, kernel and memory trials (LM_HEAD_LOSS_CHUNK_SIZE=0, as shipped)
#   qwen3_30b_a3b_lm_head_2048/  the same memory trial with LM_HEAD_LOSS_CHUNK_SIZE=2048
#   compare_lm_head.md           postprocess_profile.py compare of the two (where the memory peak went)
#   qwen3_30b_a3b_fp32_optimizer/  the same memory trial with USE_PRECISION_AWARE_OPTIMIZER=false
#                                MAIN_GRADS_DTYPE=float32 (the optimizer the shipped defaults replace)
#   compare_optimizer.md         compare of the shipped run (A) and the fp32-optimizer run (B)
#   qwen3_30b_a3b_local/         the first run with TE hidden (actor.megatron.transformer_impl=local, fp32 optimizer:
#                                TE's FusedAdam is what the precision-aware optimizer needs), both kinds
#   compare_local_vs_te.md       compare of qwen3_30b_a3b_local (A) and qwen3_30b_a3b (B)
#   qwen3_5_35b_a3b/             the Qwen3.5 YAML cut to 4 layers (3 gated delta-net + 1 full attention) at its
#                                32768 tokens, megatron:d1, both kinds
#   qwen3_5_35b_a3b_local/       the same with TE hidden (fp32 optimizer), both kinds
# Only summaries (Markdown) and plots are kept, no traces or snapshots.
# Usage (repo root):  bash docs/examples/regenerate.sh WORK_DIR [PART ...]
#   PART: qwen3_30b_a3b, lm_head_2048, fp32_optimizer, local, qwen3_5, qwen3_5_local, keep (copy what WORK_DIR holds into
#   docs/examples/); default: all, in that order. Each run part refuses to run twice into the same WORK_DIR (the driver refuses a used RUN_ROOT).
#   lm_head_2048, fp32_optimizer and local are compared with qwen3_30b_a3b's run: it must come earlier in PART or be
#   in WORK_DIR already (checked before anything runs).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$repo/docs/examples
work=${1:?usage: bash docs/examples/regenerate.sh WORK_DIR [PART ...]}
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(qwen3_30b_a3b lm_head_2048 fp32_optimizer local qwen3_5 qwen3_5_local keep)
run() {  # NAME [VAR=value ...] [-- key=value ...]: one driver run on one GPU into WORK_DIR/NAME
  local name=$1 vars=() overrides=(); shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
  [ $# -eq 0 ] || { shift; overrides=("$@"); }
  env N_GPUS_PER_NODE=1 PROFILE_RANKS= TRAIN_BATCH_SIZE=1 PROFILE_N_MBS=1 PROFILE_STEPS=2 TOTAL_STEPS=3 \
      RUN_ROOT="$work/$name" FILEROOT="$work/fileroot" "${vars[@]}" \
      bash "$repo/run_qwen3_30b_a3b_sft_profile.sh" actor.backend=megatron:d1 actor.num_layers=4 "${overrides[@]}"
}
keep() {  # NAME: copy each trial's summary and plots to docs/examples/NAME/<kind>/
  local name=$1 trial kind
  compgen -G "$work/$name/*/profile_summary.md" > /dev/null || return 0  # no summary: keep what docs/examples has
  rm -rf "${out:?}/$name"
  for trial in "$work/$name"/*/; do
    [ -f "$trial/profile_summary.md" ] || continue
    kind=$(basename "$trial" | sed -E 's/.*_(kernel|memory)_step[0-9]+_.*/\1/')
    mkdir -p "$out/$name/$kind"
    cp "$trial/profile_summary.md" "$out/$name/$kind/"
    find "$trial" -name '*.png' -exec cp {} "$out/$name/$kind/" \;
  done
}
accepted="qwen3_30b_a3b lm_head_2048 fp32_optimizer local qwen3_5 qwen3_5_local keep"
base=no; ! compgen -G "$work/qwen3_30b_a3b/*/profile_summary.md" > /dev/null || base=yes
for part in "${parts[@]}"; do  # every part is checked before anything runs
  [[ " $accepted " == *" $part "* ]] || { echo "regenerate.sh: unknown part $part; accepted: $accepted" >&2; exit 2; }
done
for part in "${parts[@]}"; do
  case $part in
    qwen3_30b_a3b) base=yes ;;
    lm_head_2048|fp32_optimizer|local) [ $base = yes ] || {
      echo "regenerate.sh: part $part is compared with the shipped run $work/qwen3_30b_a3b, which holds no trial" \
           "summary; run part qwen3_30b_a3b first (regenerate.sh '$work' qwen3_30b_a3b $part)" >&2; exit 2; } ;;
  esac
done
for part in "${parts[@]}"; do
  case $part in
    qwen3_30b_a3b) run qwen3_30b_a3b ;;
    lm_head_2048)
      run qwen3_30b_a3b_lm_head_2048 PROFILE_KINDS=memory LM_HEAD_LOSS_CHUNK_SIZE=2048
      python3 "$repo/postprocess_profile.py" compare "$work/qwen3_30b_a3b" "$work/qwen3_30b_a3b_lm_head_2048" \
          --out "$work/compare_lm_head.md" ;;
    fp32_optimizer)
      run qwen3_30b_a3b_fp32_optimizer PROFILE_KINDS=memory USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32
      python3 "$repo/postprocess_profile.py" compare "$work/qwen3_30b_a3b" "$work/qwen3_30b_a3b_fp32_optimizer" \
          --out "$work/compare_optimizer.md" ;;
    local)
      run qwen3_30b_a3b_local USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32 -- actor.megatron.transformer_impl=local
      python3 "$repo/postprocess_profile.py" compare "$work/qwen3_30b_a3b_local" "$work/qwen3_30b_a3b" \
          --out "$work/compare_local_vs_te.md" ;;
    qwen3_5) run qwen3_5_35b_a3b CONFIG="$repo/qwen3_5_35b_a3b_sft_profile.yaml" PROFILE_FAKE_SEQ_LEN=32768 ;;
    qwen3_5_local)
      run qwen3_5_35b_a3b_local CONFIG="$repo/qwen3_5_35b_a3b_sft_profile.yaml" PROFILE_FAKE_SEQ_LEN=32768 \
          USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32 -- actor.megatron.transformer_impl=local ;;
    keep)
      for name in qwen3_30b_a3b qwen3_30b_a3b_lm_head_2048 qwen3_30b_a3b_fp32_optimizer qwen3_30b_a3b_local qwen3_5_35b_a3b qwen3_5_35b_a3b_local; do
        keep "$name"
      done
      for f in compare_lm_head.md compare_optimizer.md compare_local_vs_te.md; do [ ! -f "$work/$f" ] || cp "$work/$f" "$out/"; done
      du -sh "$out" ;;
  esac
done

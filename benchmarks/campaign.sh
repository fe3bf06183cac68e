#!/usr/bin/env bash
# The tuned, multi-seed campaign behind docs/results.md's main table (and the README's headline table), through
# the sweep machinery.
#
#   bash benchmarks/campaign.sh            # 91 min for the lanes here (2 shared cores); completed runs are skipped
#
# Two lanes of one thread each (OMP_NUM_THREADS=1), one per core:
#   A: campaign_baselines (tuned) -> campaign_base (the AdamW model fine-tuning starts from) -> campaign_finetune
#   B: campaign_hmt (tuned) -> campaign_hmt_ablations at HMT default's tuned learning rate
# then campaign_long (4x the steps, 3 rows) and campaign_timing (every setting's speed measured alone: the lanes share the CPU, so their step times are
# not comparable), then the report (docs/campaign) and the main table in docs/results.md.
# Each lane's log: results/campaign-logs/<lane>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p results/campaign-logs

sweep() { python -m experiments.run -m hydra.sweeper.file="$1" "${@:2}"; }

lane_a() {
  sweep campaign_baselines
  sweep campaign_base
  sweep campaign_finetune
}

lane_b() {
  sweep campaign_hmt || return 1
  # campaign_hmt lists its 4 rows × 5 search runs first; run 20 is row 0 (HMT default) at its chosen rate, seed 1
  local job lr
  job="$(python -m experiments.sweep overrides campaign_hmt --index 20)" || return 1
  lr="$(sed -n 's/^method\.lr=//p' <<<"$job")"
  if [[ -z "$lr" ]] || grep -qE '^(activation|method\.weight_dtype|method\.mode)=' <<<"$job"; then
    echo "error: run 20 of campaign_hmt is not HMT default's final run: $job" >&2
    return 1
  fi
  sweep campaign_hmt_ablations "method.lr=$lr"
}

start=$(date +%s)
lane_a > results/campaign-logs/lane_a.log 2>&1 &
a=$!
lane_b > results/campaign-logs/lane_b.log 2>&1 &
b=$!
wait "$a"; rc_a=$?
wait "$b"; rc_b=$?
echo "campaign lanes finished in $(( ($(date +%s) - start) / 60 )) min (lane A rc $rc_a, lane B rc $rc_b)"
sweep campaign_long > results/campaign-logs/long.log 2>&1      # AdamW, GaLore, HMT at 4x the steps (flattening)
sweep campaign_timing > results/campaign-logs/timing.log 2>&1
python -m analysis.report results/campaign --timing results/campaign-timing --memory-results results/paper_memory \
  --out docs/campaign --readme docs/results.md --compile-latex

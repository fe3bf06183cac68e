#!/usr/bin/env bash
# The controls for the campaign ranking (docs/campaign/findings.md), through the sweep machinery, in priority
# order, one lane (one thread, niced: the machine is shared); completed runs are skipped, so rerunning resumes:
#
#   bash benchmarks/campaign_controls.sh
#
# then the ablation table: python -m analysis.ablation results/campaign-controls results/campaign --out docs/campaign/tables
# Log: results/campaign-logs/controls.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p results/campaign-logs
for name in identity adamw_split galore128 nolimiter galore_eps svd128 rsvd128; do
  echo "== campaign_controls_$name $(date -u +%H:%M:%S)"
  nice -n 10 python -m experiments.run -m hydra.sweeper.file="campaign_controls_$name" || echo "campaign_controls_$name: rc $?"
done >> results/campaign-logs/controls.log 2>&1

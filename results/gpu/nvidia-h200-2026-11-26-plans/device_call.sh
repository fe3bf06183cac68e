#!/bin/bash
# Second device call: NVML's idle baseline, the planner's answers on CUDA (fixed child arguments), then gpu_validate's
# smoke tests and hmt/hmt-min again (workspace-aware memory checks) with the optional checks the first call skipped.
set -u
export PYTHONUNBUFFERED=1
t() { echo "[$SECONDS s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > $OUT/nvml_idle.csv; cat $OUT/nvml_idle.csv
if [ ! -d /tmp/site/omegaconf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/pip.log 2>&1 || { t "pip failed"; tail -20 $OUT/pip.log; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD
t "plan_on_gpu"
timeout 200 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 80 --results-dir .gpu/r2 \
  .gpu/res/plans/qwen2.5-0.5b-s2048-24gib.json .gpu/res/plans/llama3.2-1b-s2048-16gib.json \
  .gpu/res/plans/llama3.2-3b-s2048-24gib.json > $OUT/plan_on_gpu.log 2>&1
t "plan_on_gpu rc=$?"; cat $OUT/plan_on_gpu.log | tail -5
tar czf $OUT/r2.tgz --exclude='*.pickle' --exclude='*.pt' -C .gpu/r2 gpu
t "gpu_validate"
timeout 190 python3 -m benchmarks.gpu_validate --methods hmt,hmt-min --budget-s 150 --results-dir .gpu/r3 \
  > $OUT/gpu_validate.log 2>&1
t "gpu_validate rc=$?"; tail -30 $OUT/gpu_validate.log
tar czf $OUT/r3.tgz --exclude='*.pickle' --exclude='*.pt' -C .gpu/r3 gpu
t done

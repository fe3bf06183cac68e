#!/bin/bash
# Device call 2: the planner's answers under the measured GPU allowance, trained on CUDA (allocator capped, NVML polled).
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
timeout ${PG_TIMEOUT:-330} python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 150 --results-dir .gpu/r2 \
  .gpu/res/plans/qwen2.5-0.5b-s2048-24gib.json .gpu/res/plans/llama3.2-1b-s2048-16gib.json \
  .gpu/res/plans/llama3.2-3b-s2048-24gib.json .gpu/res/plans/7b-s2048-16gib.json > $OUT/plan_on_gpu.log 2>&1
t "plan_on_gpu rc=$?"; tail -25 $OUT/plan_on_gpu.log
tar czf $OUT/r2.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu/r2 gpu
ls -la $OUT; t done

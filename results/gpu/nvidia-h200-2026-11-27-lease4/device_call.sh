#!/bin/bash
# Fourth lease (one call): gpu_validate reduced as on the third lease; a plan run at twice its micro-batch that must
# survive its own CUDA out-of-memory error (train.on_oom=replan); four model-card capacity cells trained on CUDA.
set -u
export PYTHONUNBUFFERED=1
t() { echo "[$SECONDS s] $*"; }
bash benchmarks/gpu_lease.sh validate 170 --methods adamw,hmt,hmt-min > $OUT/lease_validate.txt 2>&1
mv $OUT/results.tgz $OUT/validate.tgz; tail -25 $OUT/lease_validate.txt
export PYTHONPATH=/tmp/site:$PWD
t "oversize 2 with train.on_oom=replan"
timeout 130 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 120 --oversize 2 --results-dir .gpu-oom \
  gpu_call/plans/llama3.2-1b-s2048-16gib.json > $OUT/oom.log 2>&1
t "oom rc=$?"; tail -4 $OUT/oom.log | cut -c1-1500
tar czf $OUT/oom.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-oom gpu
t "capacity cells"
timeout 240 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 90 --results-dir .gpu-cap \
  gpu_call/plans/capacity-llama3.1-8b-s2048-16gib.json gpu_call/plans/capacity-mistral-7b-v0.3-s8192-16gib-lean-b2.json \
  gpu_call/plans/capacity-qwen2.5-14b-s2048-24gib.json gpu_call/plans/capacity-gemma2-9b-s2048-24gib.json \
  > $OUT/cap.log 2>&1
t "capacity rc=$?"; grep -o '"plan": "[^"]*", "verdict": "[A-Z/]*"' $OUT/cap.log
tar czf $OUT/cap.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-cap gpu
t done

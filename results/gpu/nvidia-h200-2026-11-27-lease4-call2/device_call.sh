#!/bin/bash
# Fourth lease, second call: after the fixes the first call found (an INT8 model built on the host; the memory
# fraction's device index): the OOM replan, the 8B and 14B capacity cells, Gemma-2-9B without and with
# expandable segments.
set -u
export PYTHONUNBUFFERED=1
t() { echo "[$SECONDS s] $*"; }
if [ ! -d /tmp/site/hydra_plugins ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/pip.log 2>&1 || { t "pip failed"; tail -20 $OUT/pip.log; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD
P=gpu_call/plans
t "oversize 2 with train.on_oom=replan"
timeout 100 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 95 --oversize 2 --results-dir .gpu-oom \
  $P/llama3.2-1b-s2048-16gib.json > $OUT/oom.log 2>&1
t "oom rc=$?"; grep -o '"verdict": "[A-Z/]*", "note": "[^"]\{0,200\}' $OUT/oom.log
tar czf $OUT/oom.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-oom gpu
t "capacity cells"
timeout 250 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 110 --results-dir .gpu-cap \
  $P/capacity-llama3.1-8b-s2048-16gib.json $P/capacity-qwen2.5-14b-s2048-24gib.json \
  $P/capacity-gemma2-9b-s2048-24gib.json > $OUT/cap.log 2>&1
t "capacity rc=$?"; grep -o '"plan": "[^"]*", "verdict": "[A-Z/]*", "note": "[^"]\{0,160\}' $OUT/cap.log
tar czf $OUT/cap.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-cap gpu
t "gemma with expandable segments"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 60 python3 -m benchmarks.plan_on_gpu --steps 4 \
  --timeout-s 55 --results-dir .gpu-exp $P/capacity-gemma2-9b-s2048-24gib.json > $OUT/exp.log 2>&1
t "expandable rc=$?"; grep -o '"plan": "[^"]*", "verdict": "[A-Z/]*", "note": "[^"]\{0,160\}' $OUT/exp.log
tar czf $OUT/exp.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-exp gpu
t done

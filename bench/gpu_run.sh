#!/usr/bin/env bash
# The GPU measurements in one command, on a bare GPU Python (torch, transformers, peft, accelerate):
# the `-m gpu` tests, bench/gpu_step.py for full fine-tuning and LoRA, bench/gpu_variants.py (the levers side by side), then
# bench/joint_updates.py (hosted LoRA jobs' updates in turn and in joint passes). A machine without
# network gets what it lacks from `.gpu/` (made here by `make gpu-pack`: pure-Python wheels such as
# pydantic, and the tokenizer and tiny model that tests load, so nothing is downloaded there).
#   bash bench/gpu_run.sh [extra gpu_step.py arguments]      # results in bench/results/gpu_{step,variants}_*.{json,md}
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/opentinker-site .gpu/whl/*.whl
  export PYTHONPATH="/tmp/opentinker-site:$PWD"
fi
[ -d .gpu/cache ] && export OPENTINKER_CACHE="$PWD/.gpu/cache"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider
python3 bench/gpu_step.py --adapter full "$@"
python3 bench/gpu_step.py --adapter lora "$@"
python3 bench/gpu_variants.py --adapter full --profile
python3 bench/joint_updates.py --shape qwen2.5-0.5b --jobs 4

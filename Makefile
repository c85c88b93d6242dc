# One command for the demo, one for the tests; each sets up its own virtualenv on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
CKPT := $(VENV)/bin/ckpttool
DEMO ?= demo-out
TORCH_PIN ?= torch==2.13.0
# The other legs of the torch matrix: the oldest release pyproject.toml declares and the newest released
MATRIX ?= 2.7.1 2.15.0

.PHONY: setup demo test test-pinned test-slow test-matrix test-all clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Train the tiny model on 2 CPU ranks with async checkpoints, stop, resume (and check what was loaded), then look at, convert, reshard and verify what was saved.
demo: setup
	rm -rf $(DEMO)
	$(CKPT) train --nproc 2 --steps 4 --save-every 2 --ckpt-dir $(DEMO)/run --keep-last 2 --async-save --dropout 0.1 --warmup 3
	$(CKPT) train --nproc 2 --steps 8 --save-every 2 --ckpt-dir $(DEMO)/run --keep-last 2 --async-save --dropout 0.1 --warmup 3 --verify-after-load
	$(CKPT) inspect $(DEMO)/run
	$(CKPT) inspect $(DEMO)/run/step-8 | head -12
	$(CKPT) convert $(DEMO)/run/step-8 $(DEMO)/full.pt
	$(CKPT) convert $(DEMO)/run/step-8 $(DEMO)/model.safetensors --only model --dtype bfloat16
	$(CKPT) convert $(DEMO)/full.pt $(DEMO)/roundtrip-dcp
	$(CKPT) reshard $(DEMO)/run/step-8 $(DEMO)/step-8-on-3-ranks --world-size 3
	$(CKPT) inspect $(DEMO)/step-8-on-3-ranks | head -6
	$(CKPT) verify $(DEMO)/run
	$(CKPT) verify $(DEMO)/step-8-on-3-ranks --against $(DEMO)/full.pt
	$(CKPT) verify $(DEMO)/run/step-8 --against $(DEMO)/model.safetensors --only model --cast
	$(CKPT) inspect $(DEMO)/model.safetensors | head -8
	@echo "demo finished: see $(DEMO)/"

# A newcomer's test command: the pinned torch's suite (minutes). CI (.ci/run) runs it, then test-slow and test-matrix.
test: setup
	$(PY) -m pytest -q

test-pinned: test

# The tests marked slow (more kill points, longer waits, 20 resumes under load), on the pinned torch: CI runs them after make test.
test-slow: setup
	$(PY) -m pytest -q -m slow

# The same suite on each other torch release of the matrix (each in a venv of its own; downloads torch).

test-matrix:
	bash .ci/matrix $(MATRIX)

test-all: setup
	$(PY) -m pytest -q -m ''

clean-demo:
	rm -rf $(DEMO)

# `make demo` and `make test` are the README's two commands; both set up .venv from nothing.
PY ?= python3
VENV := .venv
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export OMP_NUM_THREADS ?= 1

# What the demos need: lockstep, the examples' packages and TensorBoard.
$(VENV)/.demo: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[examples,tensorboard]'
	touch $@

# Everything the tests use, DeepSpeed included.
# Azurite, the Azure Blob server the tests start (node and npm come with the machine), installs
# beside pip (~9 s); then mosaicml-streaming beside the venv, for tests/trainer/test_streaming.py
# (the script says why).
$(VENV)/.installed: $(VENV)/.demo
	npm install --prefix $(VENV)/node --no-audit --no-fund --silent azurite@3.35.0 > $(VENV)/npm.log 2>&1 & \
	npm=$$!; \
	$(VENV)/bin/pip install --quiet -e '.[test,examples,deepspeed]' && bash scripts/install_streaming.sh $(VENV); \
	rc=$$?; wait $$npm || { cat $(VENV)/npm.log; exit 1; }; exit $$rc
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.demo
	$(VENV)/bin/lockstep -n 2 examples/train_gpt.py

demo-digits: $(VENV)/.demo
	$(VENV)/bin/lockstep -n 2 examples/train_digits.py

# pytest exits 5 when it collects nothing; that is not a failure of the suite. DeepSpeed is
# installed here, so its tests must run rather than skip. Four workers on two cores: many tests
# wait (for a rendezvous, a stall timeout, a server) as much as they compute, and with four the
# cores were idle 4% of the run rather than three's 9% (benchmarks.md, "The test suite"). One test
# handed to a worker at a time (--maxschedchunk 1), in conftest.py's order: handed in chunks, a
# worker's last chunk kept it busy about 150 s after the others had nothing left.
# The modules are compiled once first, since the machine may set PYTHONDONTWRITEBYTECODE: each of
# the suite's processes would otherwise compile the lockstep modules it imports again (~0.25 s of
# CPU in a prefork server; ~0.2 s of a 2-rank launch's 3.5 s).
TEST_WORKERS ?= 4
test: setup
	$(VENV)/bin/python -m compileall -q src tests examples
	LOCKSTEP_REQUIRE_DEEPSPEED=1 $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1 --durations=25; \
	rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

.PHONY: setup demo demo-digits test

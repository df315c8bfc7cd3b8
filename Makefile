# Two entry points, both self-installing on a fresh machine (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.commfx-installed

.PHONY: demo test test-all test-gpu install system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test,peers]'
	touch $(STAMP)

# iproute2 gives `ip`/`tc` for the emulated cluster (network namespaces); needs root.
system-deps:
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null) || \
	    echo "note: iproute2 missing and not root; emulated-cluster tests will say so"; }

demo: install
	mkdir -p out
	$(VENV)/bin/commfx run gpt-moe --passes lift,expert_parallel --world-size 4 --steps 5 --dump out/graph.txt --json out/demo.json

# Tests run on two pytest-xdist workers (2 cores: one process compiles while another waits on
# its ranks); tests that build emulated clusters share one worker (xdist_group "cluster").
# The layout's import rules (pyproject.toml, [tool.importlinter]) first: a broken rule
# fails with the import chain named, before the (longer) test run.
# `test` (what CI runs) leaves out the cases marked slow: heavier duplicates, at world 4 or on
# more HF families, of cases it runs smaller. `test-all` runs every case, the slow world-4/8 verifies and resharding runs too (much longer; not timed lately); `test` took 14 min 16 s and 14 min 55 s in two fresh clones (15 min 36 s with the install).
# Goldens are always compared here, never rewritten: COMMFX_UPDATE_GOLDEN=1 belongs on a pytest
# command run on purpose (see tests/golden_files.py).
PYTEST := env -u COMMFX_UPDATE_GOLDEN $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup

test: install system-deps
	PYTHONPATH=src $(VENV)/bin/lint-imports --no-cache
	$(PYTEST) -m "not slow"

test-all: install system-deps
	PYTHONPATH=src $(VENV)/bin/lint-imports --no-cache
	$(PYTEST)

# The GPU checks (issue 31): compiled Triton kernels against their references in fp16/bf16/fp32,
# NCCL worlds, stream lanes, verify and run on CUDA. On a CUDA machine, with the python that has
# torch there (nothing is installed: GPU machines often have no registry): `make test-gpu`.
GPU_PY ?= python3
GPU_TESTS := tests/test_kernels.py tests/test_cuda_path.py
test-gpu:
	env -u TRITON_INTERPRET PYTHONPATH=src $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu $(GPU_TESTS)

clean:
	rm -rf $(VENV) out

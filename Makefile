# Two entry points, both self-installing on a fresh machine (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.commfx-installed

.PHONY: demo test test-all test-gpu test-hf-oldest install system-deps clean

# pyproject takes torch and triton as ranges; naming the releases here makes pip take the CPU
# torch 2.13.0 wheel (fast on a fresh machine) instead of the newest multi-GB CUDA build.
TORCH := 'torch==2.13.0' 'triton==3.9.0'

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	DS_BUILD_OPS=0 $(PY) -m pip install -q $(TORCH) -e '.[test,peers]'
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
# more HF families, of cases it runs smaller. `test-all` runs every case, the slow world-4/8 verifies and resharding runs too (much longer; not timed lately); `test` took 12 min 46 s (907 passed; 11 min 51 s and 901 the day before) from a clean clone with an empty Inductor cache on a 2-core development machine, and the whole .ci/run about 16 min (14 min 35 s), installs included (2026-12-03; before the rank template and the region memo: 19 min 27 s cold, per test in benchmarks/log/2026-12-02-test_durations_cold_and_warm.tsv).
# Goldens are always compared here, never rewritten: COMMFX_UPDATE_GOLDEN=1 belongs on a pytest
# command run on purpose (see tests/golden_files.py).
PYTEST := env -u COMMFX_UPDATE_GOLDEN $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup

test: install system-deps
	PYTHONPATH=src $(VENV)/bin/lint-imports --no-cache
	$(PYTEST) -m "not slow"

test-all: install system-deps
	PYTHONPATH=src $(VENV)/bin/lint-imports --no-cache
	$(PYTEST)

# The oldest end of the supported transformers range (README, "Supported versions"), CI's second
# job: its own venv (commfx without extras, the oldest transformers), `commfx verify` through the
# command line on two families, then tests/test_hf_compat.py with its slow cases: verify on every
# family the recognisers take, and the compile door training a raw Mixtral (world 2; a few minutes).
HF_OLDEST := 5.17.0
OLD_VENV ?= .venv-hf-oldest
OLD_STAMP := $(OLD_VENV)/.commfx-installed-$(HF_OLDEST)

$(OLD_STAMP): pyproject.toml
	python3 -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install -q $(TORCH) -e . 'transformers==$(HF_OLDEST)' 'pytest>=8' 'pytest-xdist>=3.5' 'hypothesis>=6'
	touch $(OLD_STAMP)

# Compute is interpreted, as in the tests (conftest.py): this job checks the transformers range.
test-hf-oldest: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -c 'import transformers as t; assert t.__version__ == "$(HF_OLDEST)", t.__version__; print("transformers", t.__version__)'
	COMMFX_COMPUTE=interpret $(OLD_VENV)/bin/commfx verify hf:mixtral --world-size 2
	COMMFX_COMPUTE=interpret $(OLD_VENV)/bin/commfx verify hf:qwen3_moe --world-size 2
	env -u COMMFX_UPDATE_GOLDEN $(OLD_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 tests/test_hf_compat.py

# The GPU checks (issue 31): compiled Triton kernels against their references in fp16/bf16/fp32,
# NCCL worlds, stream lanes, verify and run on CUDA. On a CUDA machine, with the python that has
# torch there (nothing is installed: GPU machines often have no registry): `make test-gpu`.
GPU_PY ?= python3
GPU_TESTS := tests/test_kernels.py tests/test_cuda_path.py
test-gpu:
	env -u TRITON_INTERPRET PYTHONPATH=src $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu $(GPU_TESTS)

clean:
	rm -rf $(VENV) $(OLD_VENV) out

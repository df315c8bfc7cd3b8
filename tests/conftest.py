import os
import warnings
from pathlib import Path

import pytest
import torch

import golden_files

_CALL_PASSED = pytest.StashKey[bool]()
# Compiling costs seconds a graph: tests interpret unless they ask for compiled regions
# (tests/test_compiled_regions.py). Spawned ranks inherit it.
os.environ.setdefault("COMMFX_COMPUTE", "interpret")


def pytest_configure(config):
    """COMMFX_UPDATE_GOLDEN takes 1 or nothing: any other value stops the run before it starts."""
    error = golden_files.usage_error(os.environ.get(golden_files.UPDATE_VARIABLE, ""))
    if error:
        raise pytest.UsageError(error)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed


@pytest.fixture(autouse=True)
def _quiet_and_deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(autouse=True)
def _golden_reads(request):
    """Track the goldens each test reads; a passing test must read every one READERS declares for it."""
    test_id = f"{Path(request.node.path).name}::{request.node.name}"
    golden_files.begin_test(test_id)
    yield
    _, read = golden_files.end_test()
    missing = golden_files.unread(test_id, read)
    if missing and request.node.stash.get(_CALL_PASSED, False):
        pytest.fail(f"{test_id} did not read the goldens tests/golden_files.py declares for it: {missing}", pytrace=False)

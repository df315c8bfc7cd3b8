import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_and_deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield

"""Canonical ops (`torch.ops.commfx.*`). Importing this package registers them."""

import torch

from . import chunks, comm, embedding, fp8_dispatch, locality, moe, packed, tp, vocab_parallel  # noqa: F401  (registration side effects)

commfx = torch.ops.commfx

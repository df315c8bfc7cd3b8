"""Canonical ops (`torch.ops.commfx.*`). Importing this package registers them."""

import torch

from . import chunks, comm, embedding, fp8_dispatch, grouped_gemm, locality, moe, packed, tp, vocab_parallel  # noqa: F401  (registration side effects)

commfx = torch.ops.commfx

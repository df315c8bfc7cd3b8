"""Expert-computation kernels for MoE: grouped GEMM and row permutations.

Each public function dispatches on the device of its inputs: CUDA tensors run
the Triton kernel, CPU tensors (and dtypes the kernels do not cover) run the
torch reference named ``<name>_reference`` with the same signature.
"""

from .grouped_mm import (
    grouped_mm,
    grouped_mm_reference,
    grouped_mm_weight_grad,
    grouped_mm_weight_grad_reference,
)
from .permute import (
    gather_rows,
    gather_rows_reference,
    scatter_add_rows,
    scatter_add_rows_reference,
)

__all__ = [
    "gather_rows",
    "gather_rows_reference",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_mm_weight_grad",
    "grouped_mm_weight_grad_reference",
    "scatter_add_rows",
    "scatter_add_rows_reference",
]

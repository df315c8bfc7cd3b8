"""Expert-computation kernels for MoE: grouped GEMM, row permutations, and a device's
packed experts fused (gather, grouped GEMMs, weighted scatter-add).

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
from .packed_experts import packed_experts, packed_experts_reference
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
    "packed_experts",
    "packed_experts_reference",
    "scatter_add_rows",
    "scatter_add_rows_reference",
]

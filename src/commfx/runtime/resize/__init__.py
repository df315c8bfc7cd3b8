"""Shard widths as runtime state: ZERO-resizing and lossless migration of tp linears.

Each resizable tensor-parallel linear (`commfx.tp_linear`, placed by the resize_tp pass)
looks up its `LinearPlan` in the comm scheduler's `op_state` when it runs (none: a plain
linear). Four mechanisms change what a rank computes while every tensor, and so every
collective, keeps its shape:

- **Column resizing** (ZERO-resizing, arXiv 2401.11469; `columns.py`): a slow rank
  contracts over a kept subset S of its contraction dim, Y = X[..., S] W[:, S]^T (+ b);
  backward imputes zeros at the dropped positions of the input and weight gradients. S is
  chosen by priority: the columns whose weights changed most since the last selection (the
  largest at the first). Lossy; the relative error of the dropped part is measured on a
  few rows of every forward (`LinearPlan.error`).
- **Unit resizing** (ZERO-resizing by whole units; `unit_views.py`): where blocks have
  units (heads, blocks of MLP columns) a slow rank computes only the first k units of its
  shard, on views of their weights and activations, and nobody computes the rest: their
  rows of a column linear are zeros, their columns of the row linear are skipped, their
  gradients imputed zero. The units kept are those whose weights changed most since the
  last selection: the shard is permuted between steps to put them first (weights,
  gradients and optimizer state; permuting units within a shard leaves the block's
  function unchanged), and put back in order at full width (`Resizer.resize_units`).
  Views instead of column resizing's gathers: column resizing gathers X[..., S] and W[:, S]
  every forward and scatters both gradients every backward, a cost comparable to what the
  dropped columns save; unit resizing gathers nothing.
- **Unit migration** (the default of SEMI and `mode=migrate`, `resize_tp:migrate=units`;
  `units.py`): a slow rank (giver) hands whole units of a block -- a unit's column-parallel
  weight rows (and bias) together with the matching row-parallel weight columns -- to a
  faster rank (taker). The taker computes them end to end from the block's replicated
  input (the tensor_parallel pass's unit function: the block's own ops planned for one
  unit), so it never waits on the giver, and adds their partial product to its own before
  the row-parallel all-reduce (`commfx.tp_units`). The giver skips those output rows and
  contraction columns (`unit_views.py`). The units' weights, and each optimizer state
  tensor shaped like them (Adam's moments, momentum: elementwise optimizers), move once
  per decision, between steps, into the taker's slot parameters (`UnitSlots`, part of the
  module's parameters and state_dict), and back on recovery. No per-step traffic.
  Lossless: the same products, summed in another order; AdamW steps on a slot are the
  steps the giver would have taken (its state moved with it; `attach_optimizer` hands the
  runtime the optimizer, else moved units restart their optimizer state). Only where the
  tp group is the whole data-parallel replica (dp = 1, no pipeline): each tp group decides
  on its own, so dp replicas could disagree on layouts.
- **Column migration** (`resize_tp:migrate=columns`, for dp > 1; `columns.py`): a slow
  rank hands some contraction columns of its row-parallel linears to a faster rank every
  step: it sends X[..., M] and W[:, M], the taker adds X_M W_M^T to its own partial product
  and returns dX_M and dW_M in backward. Lossless, but X_M comes from the straggler itself,
  so the taker waits on it every step; unit migration has no such wait.

Modules: `linear_plan.py` (what one linear computes this step), `linear.py` (the
`commfx.tp_linear` op, which dispatches to `columns.py` or `unit_views.py`), `units.py`
(the `commfx.tp_units` op and the moved units' slots) and `resizer.py` (`Resizer`: the
plans of one module on this rank, changed by the decisions). Every rank of a tp group
applies the same decisions (see `runtime/semi.py`), so a migration's sends and receives
pair up.
"""

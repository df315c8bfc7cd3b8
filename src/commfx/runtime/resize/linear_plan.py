"""What one resizable tp linear computes on this rank this step: its `LinearPlan`, kept in
the comm scheduler's `op_state` under `state_key` and changed between steps by the
`Resizer`. The plan has one part per pair of mechanisms: `ColumnPlan` (column resizing and
column migration) and `UnitCut` (unit resizing and, on a giver, unit migration)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def state_key(key: str) -> str:
    return f"tp_linear:{key}"


def units_key(key: str) -> str:
    return f"tp_units:{key}"


@dataclass(frozen=True)
class Migration:
    giver: int  # tp index whose columns move
    taker: int  # tp index that computes them
    columns: tuple[int, ...]  # the giver's local contraction columns


@dataclass
class ColumnPlan:
    """Column resizing and column migration: which contraction columns this rank multiplies."""

    kept: list[int] | None = None  # resizing: the columns kept (None: all of them)
    migration: Migration | None = None
    stash: list = field(default_factory=list, repr=False)  # the taker's migrated columns, forward -> backward


@dataclass
class UnitCut:
    """Unit resizing and unit migration (giver side): the last units of this rank's shard,
    which another rank computes (given away) or nobody does (dropped)."""

    skip_rows: tuple[int, ...] = ()  # output rows (a column linear's) this rank does not compute
    skip_columns: tuple[int, ...] = ()  # contraction columns (a row linear's) this rank does not compute
    cut: tuple[int, int, int, int] | None = None  # ... the same as (outer, heads/columns, inner, kept): the first kept of each outer part
    dropped: int = 0  # unit resizing: heads/columns per outer part after the kept ones that nobody computes (imputed zero)


@dataclass
class LinearPlan:
    """What one tp linear computes on this rank this step."""

    key: str
    kind: str  # "column" | "row"
    width: int  # contraction width of this rank's shard
    tp_rank: int
    out_width: int = 0  # output rows of the weight
    sample_rows: int = 8  # rows on which the resizing error is measured
    error: float = 0.0  # relative error of the dropped columns or units in the last forward
    rows: int = 0  # rows (tokens) of the last forward
    columns: ColumnPlan = field(default_factory=ColumnPlan)
    units: UnitCut = field(default_factory=UnitCut)
    _index: torch.Tensor | None = field(default=None, repr=False)
    _rows: torch.Tensor | None = field(default=None, repr=False)

    def is_plain(self) -> bool:
        return self.columns.kept is None and self.columns.migration is None and not self.units.skip_rows and not self.units.skip_columns

    def on_views(self) -> bool:
        """Only units are cut (no column resizing or migration): computed on views of the kept units."""
        return self.units.cut is not None and self.columns.kept is None and self.columns.migration is None

    def given(self) -> bool:
        return self.columns.migration is not None and self.columns.migration.giver == self.tp_rank

    def taken(self) -> bool:
        return self.columns.migration is not None and self.columns.migration.taker == self.tp_rank

    def compute_index(self) -> torch.Tensor | None:
        """The columns this rank multiplies itself: the kept ones, less those it gives away
        (None: every column)."""
        if self._index is None:
            columns = set(range(self.width) if self.columns.kept is None else self.columns.kept)
            if self.given():
                columns -= set(self.columns.migration.columns)
            columns -= set(self.units.skip_columns)
            self._index = torch.tensor(sorted(columns), dtype=torch.long)
        return None if self._index.numel() == self.width else self._index

    def row_index(self) -> torch.Tensor | None:
        """The output rows this rank computes (None: every row); the others are zeros."""
        if not self.units.skip_rows:
            return None
        if self._rows is None:
            self._rows = torch.tensor(sorted(set(range(self.out_width)) - set(self.units.skip_rows)), dtype=torch.long)
        return self._rows

    def changed(self) -> None:
        self._index = self._rows = None

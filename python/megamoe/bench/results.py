"""What every bench records and prints: one row per implementation in a case (a `Measurement`, or a bench's own
row type), grouped per case in a `CaseResult`; the rich tables' cells and row layout; the JSON record of a case.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Generic, TypeVar

from rich.table import Table

Row = TypeVar("Row")


def first_line(exc: BaseException, limit: int = 100) -> str:
    """"Type: first line of the message" (at most `limit` characters of it), for the tables' notes."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def fmt(value: float | None, spec: str) -> str:
    """A table cell: the value formatted, "n/a" without one."""
    return "n/a" if value is None else format(value, spec)


def fmt_met(met: bool | None) -> str:
    """A table cell of a target: "-" when not judged."""
    return "-" if met is None else ("[green]yes[/]" if met else "[red]NO[/]")


def results_table(title: str, columns: Sequence[str], left: Sequence[str], caption: str | None = None) -> Table:
    """An empty table with these columns: the `left` ones left-justified (names, notes), the rest right."""
    table = Table(title=title, caption=caption)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


@dataclass(kw_only=True)
class Measurement:
    """One implementation's time in a case (None: not timed; the note says why) and the rates of the case's work
    at that time: TFLOP/s and weight GB/s (None without a time)."""

    impl: str
    time_us: float | None
    tflops: float | None = None
    weight_gbps: float | None = None
    note: str = ""

    @staticmethod
    def rates(time_us: float | None, flops: float, weight_bytes: float) -> dict[str, float | None]:
        """{"tflops", "weight_gbps"} of `flops` and `weight_bytes` done in `time_us` (None without a positive
        time)."""
        ok = time_us is not None and time_us > 0
        return {"tflops": flops / time_us / 1e6 if ok else None,
                "weight_gbps": weight_bytes / time_us / 1e3 if ok else None}


@dataclass(kw_only=True)
class CaseResult(Generic[Row]):
    """One case of a bench: its name and its rows, in table order. Subclasses add the case's parameters and the
    accounting its rows are computed from."""

    case: str
    measurements: list[Row] = field(default_factory=list)

    def record(self, row: Row) -> Row:
        self.measurements.append(row)
        return row

    def add_rows(self, table: Table, cells: Callable[[Row], Sequence[str]], label: str | None = None) -> None:
        """One table row per measurement, the case's label (default: its name) on the first only, then a
        section line."""
        for i, row in enumerate(self.measurements):
            table.add_row((self.case if label is None else label) if i == 0 else "", *cells(row))
        table.add_section()

    def as_json(self) -> dict[str, Any]:
        """Every field by name, the measurements last (as `megamoe bench` writes each result)."""
        record = asdict(self)
        record["measurements"] = record.pop("measurements")
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any], row_type: Callable[..., Row]) -> "CaseResult[Row]":
        """The result `as_json` wrote (JSON turns tuples into lists), its rows built by `row_type(**row)`."""
        names = {f.name for f in fields(cls)} - {"measurements"}
        result = cls(**{k: v for k, v in record.items() if k in names})
        for row in record.get("measurements", []):
            result.record(row_type(**row))
        return result

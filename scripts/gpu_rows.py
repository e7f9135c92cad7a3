"""The rows of ``gpu_check``'s table: each finished row goes to a JSON-lines file at once, so a run
cut off by its time limit still returns what it finished; the table and the count of rows its budget
skipped are printed last."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

BUDGET_SPENT = "time budget spent"  # the note of a row skipped because the budget ran out


@dataclass
class Row:
    check: str
    result: str = "skip"
    accepted: float | None = None
    syncs: str = "-"
    tps: str = "-"
    note: str = ""
    curve: dict | None = None  # a cost-curve row's measured milliseconds per width (gpu_prediction reads it)


class Rows(list):
    """The table's rows; ``finish`` appends a finished row to ``path`` as one JSON line at once (the
    call's files keep what finished even when the run is killed)."""

    def __init__(self, path: Path | None) -> None:
        super().__init__()
        self.path, self._finished = path, set()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")  # this run's rows only

    def add(self, row: Row) -> Row:
        self.append(row)
        return row

    def finish(self, row: Row) -> None:
        if id(row) in self._finished:
            return
        self._finished.add(id(row))
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")

    def cut_off(self, why: str) -> None:
        """Mark every row not finished (the one running when the run stopped) and write it."""
        for row in self:
            if id(row) not in self._finished:
                row.result, row.note = "cut off", why
                self.finish(row)


def table(rows: list[Row]) -> str:
    head = ("check", "result", "acc/fwd", "syncs/round", "tok/s", "note")
    body = [(r.check, r.result, "-" if r.accepted is None else f"{r.accepted:.2f}", r.syncs, r.tps, r.note)
            for r in rows]
    w = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(n) for c, n in zip(cells, w)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (n + 2) for n in w) + "|"] + [line(b) for b in body])


def skipped_line(rows: list[Row], budget: float) -> str:
    """How many rows the budget left out: a run that skips rows still exits 0, so the count is said
    in words under the table rather than left to a reader scanning it."""
    skipped = sum(r.note == BUDGET_SPENT for r in rows)
    if not skipped:
        return f"gpu_check: no row skipped for the time budget ({budget:.0f} s)"
    return f"gpu_check: {skipped} of {len(rows)} rows SKIPPED: the time budget ({budget:.0f} s) was spent (see their notes)"


class Syncs:
    """Host syncs seen by CUDA's sync debug mode (each synchronizing call warns); 0 on the CPU."""

    def __init__(self, on: bool) -> None:
        self.on, self.log = on, []

    def __enter__(self) -> "Syncs":
        if self.on:
            import torch

            self._w = warnings.catch_warnings(record=True)
            self.log = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            import torch

            torch.cuda.set_sync_debug_mode(0)
            self._w.__exit__(*exc)

    def count(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.log)

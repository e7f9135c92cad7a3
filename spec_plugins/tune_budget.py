"""tune's time budget: parsed from ``--budget``, and shared by ``tune`` and its replay predictions
(``tune_replay``), which check it between prompts. ``TuneError`` lives here so that parsing can
raise it (``spec_plugins.tune`` re-exports both)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


class TuneError(ValueError):
    """Bad input to tune (the message names it)."""


@dataclass
class Budget:
    seconds: float
    start: float = field(default_factory=time.perf_counter)

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def _spent(budget: Budget | None) -> bool:
    """Whether a pass must stop before its next prompt (None: no budget, as the bench replays)."""
    return budget is not None and budget.left <= 0


MAX_BUDGET_SECONDS = 7 * 24 * 3600


def parse_budget(text: str) -> float:
    """'5m', '90s', '1h', '300' -> seconds; finite, positive, at most a week."""
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:].lower(), None)
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise TuneError(f"--budget {text!r}: use e.g. 5m, 90s or 1h") from None
    if not math.isfinite(value) or value <= 0:  # nan fails both
        raise TuneError(f"--budget {text!r} must be a positive, finite time")
    if value > MAX_BUDGET_SECONDS:
        raise TuneError(f"--budget {text!r} is {value:.3g} s; at most {MAX_BUDGET_SECONDS // 3600} h")
    return value

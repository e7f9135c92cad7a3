"""tune's time budget: shared by ``tune`` and its replay predictions (``tune_replay``), which
check it between prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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

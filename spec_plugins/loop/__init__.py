"""The one decode loop: a batch that rows join and leave (``batch``) and the round over it (``round``)."""

from spec_plugins.loop.batch import Batch
from spec_plugins.loop.round import Step, StopFn, decode, run_round
from spec_plugins.loop.rows import Row

__all__ = ["Batch", "Row", "Step", "StopFn", "decode", "run_round"]

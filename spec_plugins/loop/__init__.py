"""The one decode loop: a batch that rows join and leave (``batch``) and the round over it (``round``)."""

from spec_plugins.loop.batch import Batch, Row
from spec_plugins.loop.round import Step, StopFn, decode, run_round

__all__ = ["Batch", "Row", "Step", "StopFn", "decode", "run_round"]

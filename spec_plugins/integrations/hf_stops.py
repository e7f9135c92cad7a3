"""The ``generate()`` stopping criteria the engine does not apply itself (it applies max length
and EOS), run as plain ``generate()`` runs them: one call per step on the whole batch.

Plain ``generate()`` calls its criteria once after each step t (t new tokens per row) with the
[B, prompt + t] batch, so a criterion may keep per-row state (``stops[b]`` against
``input_ids[b, -1]``), count its calls, or answer for the whole batch (``max_time``). Here rows
accept different numbers of tokens per round, so step t is checked once every row still running
at t holds t new tokens (rows ahead decode on; their tokens past a stop are cut), and the engine
learns of the rows that stop through the stop rule it calls at each row's next emit.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def token_ids(x: Any) -> list[int]:
    """A token id, a list of them or a tensor of them as a list of ints (None: none)."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    return [int(x)] if isinstance(x, int) else [int(v) for v in x]


def pad_of(pad_id: int | None) -> int:
    """The pad id for rows shorter than the batch; there must be one."""
    if pad_id is None:
        raise ValueError("rows finished at different lengths and there is no pad_token_id to fill them; "
                         "set generation_config.pad_token_id (or pass pad_token_id=)")
    return pad_id


class Stops:
    """The criteria left to apply, checked step by step over the caller's rows (``check``), and
    the engine's stop rule for each row (``__call__``). Rows end where plain ``generate()`` ends
    them:

    - with an EOS criterion (plain ``generate()``'s own test: a criterion with ``eos_token_id``) a
      row the criteria stop at step t keeps its first t tokens and is right-padded; later checks
      see it padded, as plain ``generate()`` pads finished rows;
    - without one (``keep_going``) plain ``generate()`` keeps appending each stopped row's real
      tokens until every row has stopped: the row decodes on, and all rows end at the last stop.

    ``max_time`` answers for the whole batch, so it ends every row at the step it fires.
    ``checked``: the steps checked so far (those columns are final); ``ended``: row -> the step
    the criteria ended it at (EOS criterion); ``end``: the step every row ends at, once known."""

    def __init__(self, criteria: Any, keep_going: bool, pad_id: int | None, pads: list[list[int]],
                 rows: list[list[int]], device: torch.device) -> None:
        self.criteria, self.keep_going, self.pad_id, self.device = criteria, keep_going, pad_id, device
        self.heads = [list(p) + list(r) for p, r in zip(pads, rows)]  # each row's padded prompt
        self.prompt = [len(r) for r in rows]
        self.checked = 0
        self.ended: dict[int, int] = {}
        self.stopped: dict[int, int] = {}  # keep_going: row -> the step the criteria stopped it at
        self.end: int | None = None

    @staticmethod
    def build(criteria: Sequence[Any], gc: Any, eos: list[int], pad_id: int | None, pads: list[list[int]],
              rows: list[list[int]], device: torch.device) -> Stops | None:
        """The criteria left to apply (None: none)."""
        from transformers.generation.stopping_criteria import (
            EosTokenCriteria,
            MaxLengthCriteria,
            StoppingCriteriaList,
        )

        rest = [c for c in criteria
                if not (isinstance(c, MaxLengthCriteria) and c.max_length >= gc.max_length)  # max_new_tokens
                and not (isinstance(c, EosTokenCriteria) and set(token_ids(c.eos_token_id)) <= set(eos))]
        if not rest:
            return None
        keep_going = not any(hasattr(c, "eos_token_id") for c in criteria)  # plain generate()'s own test
        if not keep_going and pad_id is None and len(rows) > 1:
            raise ValueError("speculative_generate: a stopping criterion with an eos_token_id pads the rows it stops, "
                             "and there is no pad_token_id to pad them with: pass pad_token_id=")
        return Stops(StoppingCriteriaList(rest), keep_going, pad_id, pads, rows, device)

    def __call__(self, i: int, tokens: Sequence[int], n_new: int) -> int | None:
        """The engine's stop rule: how many of row ``i``'s ``n_new`` newest tokens it keeps before
        it ends (None: it goes on). A row the checks ended keeps none of the tokens it decoded
        since (the caller cuts those it already holds)."""
        at = self._end_of(i)
        before = len(tokens) - n_new - self.prompt[i]
        if at is None or before + n_new < at:
            return None
        return max(0, at - before)

    def settle(self, out: list[list[int]], done: list[bool],
               errors: dict[int, tuple[int, str]]) -> tuple[int, dict[int, tuple[int, str]]]:
        """``check`` up to the first column a row failed at (``errors``: row -> (its kept tokens,
        why); plain ``generate()`` raises while making the next one), dropping the failures of
        rows the criteria ended first; (tokens cut, failures left)."""
        cut = 0
        while True:
            cut += self.check(out, done, min((n for n, _ in errors.values()), default=None))
            left = {i: e for i, e in errors.items() if (at := self._end_of(i)) is None or at > e[0]}
            if len(left) == len(errors):
                return cut, errors
            errors = left

    def check(self, out: list[list[int]], done: list[bool], limit: int | None = None) -> int:
        """Check every step now decided (up to ``limit``) and cut the rows that end; ``out``: each
        row's new tokens, ``done``: the rows the engine finished. Returns how many tokens were cut."""
        cut = 0
        while self.end is None and (limit is None or self.checked < limit):
            t = self.checked + 1
            # a row finished before step t (by the engine, or ended by a check and cut) holds fewer tokens
            running = [i for i, o in enumerate(out) if len(o) >= t or not (done[i] or i in self.ended)]
            if not running or any(len(out[i]) < t for i in running):
                break  # every row finished, or a running row has not made step t yet
            hit = self.criteria(self._batch(out, t), None)
            self.checked = t
            for i in running:
                if bool(hit[i]):
                    self._stop(i, t, len(out))
            cut += self._cut(out)
        return cut + self._cut(out)

    def _batch(self, out: list[list[int]], t: int) -> torch.Tensor:
        """The [B, padded prompt + t] batch plain ``generate()`` checks at step t: rows that
        finished earlier right-padded."""
        seqs = []
        for head, o in zip(self.heads, out):
            new = o[:t]
            seqs.append(head + new + [pad_of(self.pad_id)] * (t - len(new)) if len(new) < t else head + new)
        return torch.tensor(seqs, dtype=torch.long, device=self.device)

    def _stop(self, i: int, t: int, n_rows: int) -> None:
        if not self.keep_going:
            self.ended.setdefault(i, t)
        elif i not in self.stopped:
            self.stopped[i] = t
            if len(self.stopped) == n_rows:
                self.end = t

    def _end_of(self, i: int) -> int | None:
        """The step row ``i`` ends at, once a check decided it (None: not yet)."""
        ends = [e for e in (self.ended.get(i), self.end) if e is not None]
        return min(ends) if ends else None

    def _cut(self, out: list[list[int]]) -> int:
        """Cut each ended row to its end (tokens it decoded past the step it ended at, emitted
        before the check); how many were cut."""
        gone = 0
        for i, o in enumerate(out):
            at = self._end_of(i)
            if at is not None and len(o) > at:
                gone += len(o) - at
                del o[at:]
        return gone

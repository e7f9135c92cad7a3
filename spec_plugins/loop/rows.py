"""One row of the batch: a sequence being decoded, and how tokens join it (its end decided by
EOS, its limit, its grammar and its stop rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from spec_plugins.loop.logprobs import row_logprobs
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.types import Emission, RowStop


@dataclass
class Row:
    """One sequence being decoded. ``tokens[-1]`` is pending (emitted, not yet cached)."""

    key: Hashable
    tokens: list[int]
    prompt_len: int
    max_new: int
    pipeline: LogitsPipeline
    generator: torch.Generator | None
    prefix: tuple[int, ...] = ()
    stop: RowStop | None = None
    logprobs: bool = False
    tenant: Hashable = None
    hidden: torch.Tensor | None = None  # [T, H] target features the proposer has not consumed (``keep_features``)
    seen: torch.Tensor | None = None  # [L] prefix + tokens on the device, for user logits processors
    grammar: Any = None  # ``grammar.RowGrammar``: the constraint on this row's output
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when this row's sampling failed; it leaves at the next round
    seed: tuple[int, int] | None = None  # (seed, lane) of a seeded row: its samples are keyed (``keyed_draws``)

    @property
    def n_new(self) -> int:
        return len(self.tokens) - self.prompt_len

    def keep_features(self, new: torch.Tensor, need: int) -> None:
        """Hold the last ``need`` committed target features: this round's ``new`` [T, H] after those
        still pending from rounds the proposer did not draft. A proposer that consumed last round's
        needs at most ``new``: a view of it, no device op; only a gap costs a concatenation."""
        n = new.shape[0]
        if need <= n or self.hidden is None:
            self.hidden = new[n - min(need, n):]  # need 0: empty (new[-0:] would be all of it)
        else:
            old = self.hidden.shape[0]
            self.hidden = torch.cat([self.hidden[max(0, old - (need - n)):], new])

    def fail(self, message: str) -> None:
        """End this row alone with finish reason ``error`` (it leaves at the next round)."""
        self.error, self.done, self.finish_reason = message, True, "error"

    def emit(self, toks: list[int], eos: set[int], host: dict, b: int) -> Emission:
        """Append tokens, stopping at EOS, the row's limit, its grammar or its stop rule (``host``:
        the round's fetch, this row's logprobs in it at batch index ``b``). The rules apply as in
        one-token rounds, so a round's several tokens end the row as plain decoding would: the
        tokens before one the grammar refuses are kept and go through the stop rule, and only a
        row they do not stop fails."""
        out: list[int] = []
        ends = eos if self.grammar is None else eos | set(self.grammar.eos)  # a grammar's end of sequence ends it
        for t in toks[: self.max_new - self.n_new]:
            out.append(t)
            if t in ends:
                self.finish_reason = "eos_token"
                break
        accepted = self.grammar.advance(out) if self.grammar is not None else len(out)
        refused = accepted < len(out)
        if refused:  # cut before the refused token; a refused EOS no longer ends the row, it fails below
            out, self.finish_reason = out[:accepted], None
        self.tokens.extend(out)
        if self.stop is not None and out:
            keep = self.stop(self.tokens, len(out))
            if keep is not None:
                del self.tokens[len(self.tokens) - len(out) + keep:]
                out, self.finish_reason = out[:keep], "stop"
        if refused and self.finish_reason is None:
            self.fail(f"the output left its grammar: {self.grammar.error}")
        if self.finish_reason is None and self.n_new >= self.max_new:
            self.finish_reason = "length"
        self.done = self.finish_reason is not None
        lps = row_logprobs(host, b, len(out)) if self.logprobs else []
        return Emission(self.key, out, lps, self.finish_reason, self.error)

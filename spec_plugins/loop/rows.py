"""One row of the batch: a sequence being decoded, and how tokens join it (its end decided by
EOS, its limit, its grammar and its stop rule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from spec_plugins.loop.logprobs import row_logprobs
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.transfer import upload_tensor
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
    features: list[torch.Tensor] = field(default_factory=list)  # [T_i, H] chunks, oldest first: committed target
    # features the proposer has not consumed (``keep_features``; read whole as ``hidden``)
    seen: torch.Tensor | None = None  # [L] prefix + tokens on the device, for user logits processors
    grammar: Any = None  # ``grammar.RowGrammar``: the constraint on this row's output
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when this row's sampling failed; it leaves at the next round
    seed: tuple[int, int] | None = None  # (seed, lane) of a seeded row: its samples are keyed (``keyed_draws``)

    @property
    def n_new(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def hidden(self) -> torch.Tensor | None:
        """The held features as one [T, H] tensor: chunks of rounds the proposer did not draft are
        joined here, once, when a drafter reads them (not every round they wait)."""
        if len(self.features) > 1:
            self.features = [torch.cat(self.features)]
        return self.features[0] if self.features else None

    @hidden.setter
    def hidden(self, value: torch.Tensor | None) -> None:
        self.features = [] if value is None else [value]

    def keep_features(self, new: torch.Tensor, need: int | None) -> None:
        """Hold the last ``need`` committed target features (None: this round's ``new`` [T, H]):
        ``new`` after the chunks still pending from rounds the proposer did not draft. Views only:
        chunks no longer needed are dropped whole and the oldest kept one sliced, no device op."""
        chunks, total = self.features + [new], sum(c.shape[0] for c in self.features) + new.shape[0]
        need = new.shape[0] if need is None else need
        while chunks and total - chunks[0].shape[0] >= need:
            total -= chunks.pop(0).shape[0]
        if chunks and total > need:
            chunks[0] = chunks[0][total - need:]
        self.features = chunks or [new[new.shape[0]:]]  # need 0: an empty [0, H] view

    def fail(self, message: str) -> None:
        """End this row alone with finish reason ``error`` (it leaves at the next round)."""
        self.error, self.done, self.finish_reason = message, True, "error"

    def emit(self, toks: list[int], eos: set[int], host: dict, b: int,
             failed: tuple[int, str] | None = None) -> Emission:
        """Append tokens, stopping at EOS, the row's limit, its grammar or its stop rule (``host``:
        the round's fetch, this row's logprobs in it at batch index ``b``). The rules apply as in
        one-token rounds, so a round's several tokens end the row as plain decoding would: the
        tokens before one the grammar refuses, or the first k where ``failed`` = (k, error) (the
        node after them had no distribution: ``verdicts.failures``), are kept and go through the
        stop rule, and only a row they do not end fails."""
        if failed is not None:
            toks = toks[: failed[0]]
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
            if keep == len(out) and self.finish_reason == "eos_token" and getattr(self.stop, "eos_first", False):
                keep = None  # the EOS token completed a spelled stop (``StopStrings.eos_first``): EOS ends it
            if keep is not None:
                del self.tokens[len(self.tokens) - len(out) + keep:]
                out, self.finish_reason = out[:keep], "stop"
        if refused and self.finish_reason is None:
            self.fail(f"the output left its grammar: {self.grammar.error}")
        if self.finish_reason is None and self.n_new >= self.max_new:
            self.finish_reason = "length"
        if failed is not None and self.finish_reason is None:  # ended first: plain decoding never reads that node
            self.fail(failed[1])
        self.done = self.finish_reason is not None
        lps = row_logprobs(host, b, len(out)) if self.logprobs else []
        return Emission(self.key, out, lps, self.finish_reason, self.error)


def seen_sequences(rows: Sequence[Row], device: torch.device) -> list[torch.Tensor]:
    """The sequences the rows' user processors see (each row's prefix + its tokens), kept on the
    device per row (``Row.seen``) and extended by the tokens emitted since (a round copies those only)."""
    out = []
    for r in rows:
        want = len(r.prefix) + len(r.tokens)
        have = r.seen.shape[0] if r.seen is not None else 0
        if have < want:
            new = (list(r.prefix) + r.tokens)[have:] if have < len(r.prefix) else r.tokens[have - len(r.prefix):]
            add = upload_tensor(new, device)
            r.seen = add if r.seen is None else torch.cat([r.seen, add])
        out.append(r.seen)
    return out

"""Which batch a runtime's rows belong to.

A runtime's caches (and a row-aware proposer's per-row state, and a draft model's runtime) hold
the rows of one batch at a time. A batch claims them when it is built; a batch built later over
them (another generation on the same decoder, or on a decoder sharing its draft model's runtime)
takes them over, and the earlier one then refuses to go on instead of decoding on the other's rows.
"""

from __future__ import annotations

from typing import Any, Sequence


def drafter_runtimes(proposer: Any | None, sources: Sequence[Any] = ()) -> list[Any]:
    """The runtimes the proposer and its drafters (``sources``: a hybrid's children) decode on:
    a draft model's, which decoders over several targets may share."""
    drafters = [proposer, *sources] if proposer is not None else []
    return [r for r in (getattr(d, "runtime", None) for d in drafters) if r is not None]


def holders(runtime: Any, proposer: Any | None, traits: Any) -> list[Any]:
    """What holds a batch's rows besides itself: the runtime, a row-aware proposer, and the
    runtimes its drafters decode on (``drafter_runtimes``), so one thread interleaving the streams
    of decoders sharing a draft model's runtime is caught here."""
    own = drafter_runtimes(proposer, traits.sources)
    return list({id(h): h for h in [runtime, *([proposer] if traits.row_aware else []), *own]}.values())


class Lease:
    """One batch's claim on what holds its rows besides itself: each holder carries the claim's
    token as ``batch_lease`` while this claim is the latest."""

    def __init__(self) -> None:
        self._token = object()  # what the holders carry: refers to nothing, so it keeps nothing alive
        self._holders: list[Any] = []

    def claim(self, holders: Sequence[Any]) -> None:
        """Take ``holders`` over (from any batch that held them before)."""
        self._holders = list(holders)
        for holder in self._holders:
            holder.batch_lease = self._token

    @property
    def held(self) -> bool:
        """Whether every holder still carries this claim (no later batch took one over)."""
        return all(getattr(h, "batch_lease", None) is self._token for h in self._holders)

    def check(self) -> None:
        """Refuse to go on over a runtime another batch took over: its caches now hold that
        batch's rows, so a round here would decode on them."""
        if not self.held:
            raise RuntimeError("another generation on this decoder started before this one finished (two stream() "
                               "generators interleaved, or a stream resumed after another generate()); its runtime "
                               "now holds the other generation's rows. Finish or close a stream before starting the "
                               "next generation on the same decoder (or on one sharing its draft model's runtime), or "
                               "give each its own decoder and runtimes")


def check_held(runtime: Any, rows: Sequence[Any], proposer: Any | None) -> None:
    """A batch's invariants over what holds its rows: the runtime holds exactly ``rows``, each live
    row's cache is its sequence minus the pending token, and a row-aware ``proposer`` (None: none)
    follows the same rows."""
    lengths = runtime.lengths()
    if len(lengths) != len(rows):
        raise AssertionError(f"the runtime holds {len(lengths)} rows, the batch {len(rows)}")
    for n, r in zip(lengths, rows):
        if not r.done and n != len(r.tokens) - 1:
            raise AssertionError(f"row {r.key!r}: the runtime caches {n} tokens, the row has {len(r.tokens) - 1}")
    if proposer is not None and proposer.num_rows() != len(rows):
        raise AssertionError(f"the proposer follows {proposer.num_rows()} rows, the batch {len(rows)}")

"""Replay draft-length policies over recorded greedy outputs, through the real round.

Under greedy decoding every method emits the same tokens (the bench checks it), and a proposer
that only reads the sequence (n-gram) drafts the same tokens whatever the model computes. So a
runtime whose logits put all mass on the recorded next token (``ReplayRuntime``) makes the real
round (``loop.round.run_round``: the same policy calls, budgets, drafts, verifier and commits)
take exactly the decisions it took with the model, in microseconds per round. Time comes from a
clock: ``SimClock`` charges each forward the measured cost model (the prefill: the curve at the
prompt's length), each drafting call the drafter's measured cost inside the round's draft step
(where the real round times it), and a per-round overhead (how ``auto`` is tuned against every
fixed gamma without a full bench per setting). Rates are the bench's: tokens/s counts every new
token over the whole generation, prefill included; "accepted" is tokens emitted per row-round
(``DecodeStats.mean_accepted_tokens``: plain decoding = 1.0). ``TapeClock``
plays back the clock readings of a recorded run, so the replay must reproduce its decisions
exactly (a test checks it). A proposer with cross-request memory (suffix, ``scope: global``)
keeps it over the turns the bench's ``--memory`` kept it over (``memory_spans``). The bench
itself remains the measurement.

    python -m spec_plugins.bench.replay --report bench-out/report.json --prompts examples/prompts/dev.jsonl
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import torch

from spec_plugins.backends.base import RuntimeCapabilities, StepOutput
from spec_plugins.bench.recorded import (SEQUENCE_ONLY, check_replayable, memory_spans, not_replayable,  # noqa: F401
                                         read_report, recorded_prompts, report_config, report_limits,
                                         round_overhead, turns_from_report)
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import DEFAULTS, AutoDraftLength, Costs, DraftCost, DraftPolicy, FixedLength, ForwardCost
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.tree import TreeLayout
from spec_plugins.types import Draft, Ranked
from spec_plugins.verifiers import ExactVerifier


class SimClock:
    """Simulated seconds: advanced by the replay runtime, read by the round."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TapeClock:
    """Records every reading of the real clock, or plays a recording back in order."""

    def __init__(self, tape: Sequence[float] | None = None) -> None:
        self.tape = list(tape) if tape is not None else []
        self.recording = tape is None
        self._i = 0

    def __call__(self) -> float:
        if self.recording:
            self.tape.append(time.perf_counter())
            return self.tape[-1]
        t = self.tape[min(self._i, len(self.tape) - 1)]
        self._i += 1
        return t


class ReplayRuntime:
    """A runtime whose logits are a point mass at each row's recorded next token.

    ``outputs`` maps a prompt (token tuple) to the tokens recorded after it. A forward's node at
    depth d predicts the recorded token at the row's next position + d (nodes off the recorded
    path are never reached by greedy verification). ``clock``, if given, is charged
    ``cost(rows, N)`` per forward (the prefill: N = the longest prompt) and ``overhead`` per
    commit; ``draft`` is the drafter's cost, charged in the draft step (``_ChargedDrafting``)."""

    def __init__(self, outputs: dict[tuple[int, ...], Sequence[int]], vocab_size: int, max_context: int = 1 << 20,
                 clock: SimClock | None = None, cost: ForwardCost | None = None, overhead: float = 0.0,
                 draft: DraftCost = DraftCost()) -> None:
        self.outputs = {k: list(v) for k, v in outputs.items()}
        self.vocab_size, self.max_context = vocab_size, max_context
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=False, name="replay")
        self.device = torch.device("cpu")
        self.clock, self.cost, self.overhead, self.draft = clock, cost, overhead, draft
        # what a fixed-length policy sizes trees by on this runtime: the recorded curve, one sizer
        # for every turn (as a decoder keeps them across generations)
        self.costs = Costs(cost) if cost is not None else None
        self.sizer = TreeSizer()
        self.seqs: list[list[int]] = []  # per row: prompt + recorded output (the oracle)
        self.held: list[int] = []  # per row: tokens in the "cache"

    def _logits(self, rows: Sequence[int], depth: torch.Tensor) -> torch.Tensor:
        N = int(depth.numel())
        out = torch.full((len(rows), N, self.vocab_size), -1e4)
        for i, b in enumerate(rows):
            seq, at = self.seqs[b], self.held[b]
            for j, d in enumerate(depth.tolist()):
                p = at + d + 1
                out[i, j, seq[p] if p < len(seq) else 0] = 0.0
        return out

    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        first = len(self.seqs)
        for r in rows:
            if tuple(r) not in self.outputs:
                raise KeyError(f"no recorded output for a prompt of {len(r)} tokens")
            self.seqs.append(list(r) + self.outputs[tuple(r)])
            self.held.append(len(r) - 1)  # the prefill's logits come from the last prompt token
        out = self._logits(range(first, len(self.seqs)), torch.zeros(1, dtype=torch.long))
        self.held[first:] = [len(r) for r in rows]
        self._charge(len(rows), max(len(r) for r in rows))
        return StepOutput(out)

    def _charge(self, rows: int, positions: int) -> None:
        """One forward's modelled seconds on the clock."""
        if self.clock is not None and self.cost is not None:
            self.clock.now += self.cost(rows, positions)

    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        self.seqs, self.held = [], []
        return self.add_rows(rows)

    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: bool = False) -> StepOutput:
        B, N = tokens.shape
        depth = tree.depth if tree is not None else torch.arange(N)
        out = self._logits(range(B), depth)
        self._charge(B, N)
        return StepOutput(out)

    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        self.held = [h + len(k) for h, k in zip(self.held, keep)]
        if self.clock is not None:
            self.clock.now += self.overhead

    def rollback(self, lengths: Sequence[int]) -> None:
        self.held = [min(h, int(n)) for h, n in zip(self.held, lengths)]

    def lengths(self) -> list[int]:
        return list(self.held)

    def select_rows(self, rows: Sequence[int]) -> None:
        self.seqs = [self.seqs[r] for r in rows]
        self.held = [self.held[r] for r in rows]


def recorded_limit(output: Sequence[int], max_new: int | None, eos_ids: Sequence[int]) -> int:
    """The limit to replay a recorded turn with: the recording's ``max_new`` (it caps the last rounds'
    drafts, so a turn that ended on EOS before it needs it, not its length), else the output's
    length. A turn these limits cannot have ended (too long, or short without an EOS) is refused."""
    if max_new is None:
        return len(output)
    if len(output) > max_new:
        raise ValueError(f"a recorded output of {len(output)} tokens is longer than max_new_tokens {max_new}")
    if len(output) < max_new and not (output and output[-1] in set(eos_ids)):
        raise ValueError(f"a recorded output of {len(output)} tokens ends before max_new_tokens {max_new} on "
                         f"none of the EOS ids {sorted(set(eos_ids))}: the replay would decode past the recording")
    return max_new


def replay_turn(prompt: Sequence[int], output: Sequence[int], proposer: Any, policy: Any, cost: ForwardCost,
                overhead: float, draft: DraftCost = DraftCost(), max_new: int | None = None,
                eos_ids: Sequence[int] = (), vocab_size: int | None = None) -> DecodeStats:
    """Decode one recorded greedy turn again through the real round (``max_new``/``eos_ids`` as the
    recording had them: ``recorded_limit``); stats carry simulated time."""
    limit, clock = recorded_limit(output, max_new, eos_ids), SimClock()
    rt = ReplayRuntime({tuple(prompt): output}, vocab_size or max(max(prompt), max(output)) + 1, clock=clock,
                       cost=cost, overhead=overhead, draft=draft)
    return _decode_recorded(rt, clock, proposer, policy, prompt, limit, eos_ids)


def _drafted(draft: Draft | Ranked | None) -> int:
    """Nodes a drafting call produced for its widest row (what a drafter's per-token cost is paid for)."""
    if isinstance(draft, Draft):
        return int(draft.tokens.shape[1])
    if isinstance(draft, Ranked):
        shaped = sum(len(sh.estimates) for sh in draft.shaped)
        return shaped + max((sum(r.size for r in alts) for alts in draft.rows), default=0)
    return 0


class _ChargedDrafting(DraftPolicy):
    """A policy's own state and decisions, its draft step charging the drafter's modelled seconds
    to the clock: the real round times drafting there (``RoundTimes.draft``), which ``Costs.observe``
    leaves out of the forward's width cost and ``AutoDraftLength`` prices as ``draft(k)``."""

    __slots__ = ("_clock", "_cost")  # its own two fields, outside the shared state

    def __init__(self, policy: DraftPolicy, clock: SimClock, cost: DraftCost) -> None:
        self.__dict__ = policy.__dict__  # the same state: what the rounds teach it, the policy keeps
        self._clock, self._cost = clock, cost

    def draft(self, sources: Sequence[Any], ctx: Any) -> Draft | Ranked | None:
        out = super().draft(sources, ctx)
        self._clock.now += self._cost(_drafted(out))
        return out


def _decode_recorded(rt: ReplayRuntime, clock: SimClock, proposer: Any, policy: Any, prompt: Sequence[int],
                     max_new: int, eos_ids: Sequence[int] = ()) -> DecodeStats:
    """One greedy generation through the real round on a replay runtime."""
    stats = DecodeStats()
    if not isinstance(policy, DraftPolicy):
        policy = DraftPolicy(policy, rt.sizer, rt.costs)
    charged = _ChargedDrafting(policy, clock, rt.draft)
    for _ in decode(rt, proposer, ExactVerifier(), LogitsPipeline(SamplingConfig()), [list(prompt)],
                    max_new, eos_ids, None, stats, charged, clock=clock):
        pass
    return stats


def replay_sequence(turns: Sequence[tuple[str, list[int], list[int]]], make_proposer: Callable[[Any], Any],
                    make_policy: Callable[[], Any], cost: ForwardCost, overhead: float,
                    draft: DraftCost = DraftCost(), max_new: int | None = None,
                    eos_ids: Sequence[int] = ()) -> dict[str, dict[str, float]]:
    """Per category (and "all"): tokens/s and accepted tokens per row-round (``rates``), the turns
    decoded in order by ONE proposer on one runtime, so cross-request memory (suffix) carries
    between them; ``max_new``/``eos_ids``: the recording's (``recorded_limit``)."""
    clock = SimClock()
    vocab = max(max(max(p), max(o)) for _, p, o in turns) + 1
    rt = ReplayRuntime({tuple(p): o for _, p, o in turns}, vocab, clock=clock, cost=cost, overhead=overhead,
                       draft=draft)
    prop = make_proposer(rt)  # given the runtime: proposers that size by its cost curve read it
    acc: dict[str, DecodeStats] = {}
    for cat, prompt, out in turns:
        limit = recorded_limit(out, max_new, eos_ids)
        stats = _decode_recorded(rt, clock, prop, make_policy(), prompt, limit, eos_ids)
        for c in (cat, "all"):
            acc[c] = acc.get(c, DecodeStats()).merge(stats)
    return {c: rates(st) for c, st in acc.items()}


def rates(stats: DecodeStats) -> dict[str, float]:
    """A replay's figures as the bench reports them: every new token over the whole generation's
    seconds, prefill included (``TurnRun``), and tokens emitted per row-round (plain decoding = 1.0)."""
    return {"tokens_per_s": stats.tokens_per_second, "accepted": stats.mean_accepted_tokens}


def fixed(k: int) -> Callable[[], Any]:
    return lambda: FixedLength(k)


def auto(cost: ForwardCost, draft: DraftCost = DraftCost(), **kwargs: Any) -> Callable[[], Any]:
    """``auto`` as the decoder builds it (``build_policy``): ``DEFAULTS``' depth and margin over
    no draft (``kwargs`` override them), one ``Costs`` (online correction, overhead) and one tree
    sizer shared by every turn, fresh acceptance estimates per turn. ``draft``: the drafter's
    cost, as the replay charges it."""
    costs, sizer = Costs(cost), TreeSizer()
    kwargs = {"max_k": DEFAULTS.max_k, "min_gain": DEFAULTS.min_gain, **kwargs}
    return lambda: DraftPolicy(AutoDraftLength(costs, draft, **kwargs), sizer, costs)


def replay_report(turns: Sequence[tuple[str, list[int], list[int]]], make_proposer: Callable[[], Any],
                  policies: dict[str, Callable[[], Any]], cost: ForwardCost, overhead: float,
                  draft: DraftCost = DraftCost(), max_new: int | None = None,
                  eos_ids: Sequence[int] = (), spans: Sequence[int] | None = None) -> dict[str, dict[str, float]]:
    """tokens/s (``rates``) per policy and category (plus "all") over ``turns`` = (category, prompt
    ids, output); ``max_new``/``eos_ids``: the recording's (``recorded_limit``). ``spans``: turns
    per span of the bench's cross-request memory (``memory_spans``), each decoded in order by one
    proposer, as the bench's were; None: a fresh proposer per turn."""
    starts = _span_starts(spans, len(turns))
    sums: dict[str, dict[str, DecodeStats]] = {}
    for name, factory in {"plain": fixed(0), **policies}.items():
        acc = sums.setdefault(name, {})
        for i, (cat, prompt, out) in enumerate(turns):
            if i in starts:
                prop = make_proposer()
            st = replay_turn(prompt, out, prop, factory(), cost, overhead, draft, max_new, eos_ids)
            for c in (cat, "all"):
                acc[c] = acc.get(c, DecodeStats()).merge(st)
    return {name: {c: rates(st)["tokens_per_s"] for c, st in cats.items()} for name, cats in sums.items()}


def _span_starts(spans: Sequence[int] | None, turns: int) -> set[int]:
    """The turns where a span of cross-request memory begins (None: every turn)."""
    if spans is None:
        return set(range(turns))
    if any(n < 1 for n in spans) or sum(spans) != turns:
        raise ValueError(f"memory spans {list(spans)} do not cover the {turns} turns one by one")
    return {sum(spans[:j]) for j in range(len(spans))}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="report.json of a greedy n-gram bench run")
    ap.add_argument("--prompts", required=True, help="the prompts file that bench run used")
    ap.add_argument("--config", default=None, help="config (tokenizer + proposer); default: the report's")
    ap.add_argument("--gammas", default="1-8", help="fixed draft lengths that auto is compared with")
    args = ap.parse_args(argv)
    from spec_plugins.bench.cli import parse_gammas
    from spec_plugins.config import ConfigError
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.registry import PROPOSERS

    try:  # refused before the replay's work: auto is compared with the best fixed draft length
        gammas = parse_gammas(args.gammas)
    except ValueError as exc:
        ap.error(str(exc))
    if not gammas:
        ap.error(f"--gammas {args.gammas!r} names no draft length; the replay compares auto with the best of them")
    try:
        report = read_report(args.report)
    except ValueError as exc:
        ap.error(f"--report {args.report}: {exc}")
    if why := not_replayable(report["meta"]):
        ap.error(f"--report {args.report}: {why}")
    try:
        cfg = report_config(report, args.config)
        check_replayable(cfg.proposer.type)
    except ConfigError as exc:
        ap.error(f"{exc}; give --config (the config the bench ran with)")
    except ValueError as exc:  # the proposer (check_replayable)
        ap.error(f"{exc}; give --config with one of them")
    try:  # the prompts file matches the report before the model loads
        recorded_prompts(report, args.prompts)
    except (OSError, ValueError) as exc:
        ap.error(f"--prompts: {exc}")
    dec = SpeculativeDecoder.from_config(cfg)
    cm = report["cost_model"]
    cost = ForwardCost.from_curve(cm.get("raw_target_seconds") or cm["target_seconds"])
    draft = DraftCost(cm["draft_round_seconds"], cm["draft_step_seconds"])
    turns = turns_from_report(report, args.prompts, dec)
    pcfg = cfg.proposer
    make = lambda: PROPOSERS.get(pcfg.type)(pcfg)  # noqa: E731
    policies: dict[str, Callable[[], Any]] = {f"k{g}": fixed(g) for g in gammas}
    policies["auto"] = auto(cost, draft)
    over = round_overhead(report)
    try:
        sim = replay_report(turns, make, policies, cost, over, draft, **report_limits(report, dec),
                            spans=memory_spans(report))
    except ValueError as exc:  # a turn that the report's limits cannot have ended (recorded_limit)
        ap.error(f"--report {args.report}: {exc}; the config's tokenizer must be the bench's")
    measured = {("plain" if m["name"] == "plain" else m["name"].replace("ours_", "")): report["summary"][m["name"]]
                for m in report["methods"] if m["kind"] in ("ours",) or m["name"] == "plain"}
    cats = list(dict.fromkeys(c for c, _, _ in turns)) + ["all"]
    print(f"overhead per round {over * 1e3:.2f} ms; simulated (measured) tokens/s")
    print("policy  " + "".join(f"{c:>18}" for c in cats))
    for name, row in sim.items():
        cells = []
        for c in cats:
            m = measured.get(name, {}).get(c, {}).get("tokens_per_s")
            cells.append(f"{row[c]:8.1f} ({m:5.1f})" if m else f"{row[c]:8.1f}        ")
        print(f"{name:8}" + "".join(f"{x:>18}" for x in cells))
    fixed_names = [n for n in sim if n.startswith("k")]
    for c in cats:
        best = max(fixed_names, key=lambda n: sim[n][c])
        ratio = f"{sim['auto'][c] / sim[best][c]:.3f}" if sim[best][c] else "–"
        print(f"{c:14} best fixed {best} {sim[best][c]:.1f}; auto/best {ratio}")


if __name__ == "__main__":
    main()

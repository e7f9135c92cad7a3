"""Run every method on every prompt in one process, interleaved, and collect raw numbers.

Order: for each prompt, for each run, every method once (rotated per run: A B C, B C A, ...), so
machine drift and contention hit all methods alike; the report takes medians over runs. Methods
are the registered baselines plus ours at each fixed gamma and ``auto``, all on ONE loaded
runtime. Multi-turn prompts feed each method its own previous answers.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spec_plugins.bench.methods import check_compare_sampling, check_labels, method_config, ours_name, plain_of
from spec_plugins.bench.baselines import (
    BASELINES,
    BaselineContext,
    BaselineUnavailable,
    TurnFn,
    TurnRun,
    drafts,
    time_decoder,
)
from spec_plugins.bench.prompts import BenchPrompt, check_prompts
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy import AutoDraftLength, DraftPolicy
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.types import RoundRecord
from spec_plugins.stats import DecodeStats


MAX_GAMMA = 64  # the longest fixed draft length the bench runs


@dataclass
class BenchOptions:
    max_new_tokens: int = 128
    runs: int = 1
    # peers that do not apply to the target's runtime are skipped with a message
    baselines: Sequence[str] = ("plain", "transformers", "llamacpp", "llamacpp_prompt_lookup")
    gammas: Sequence[int] = tuple(range(1, 9))
    auto: bool = True
    baseline_gamma: int | None = None  # gamma for peers; None = the config's, or 5 when it is auto
    chat: bool = True  # wrap turns in the chat template when the model has one
    warmup: bool = True
    progress: bool = True
    cost_positions: int = 32
    # other runtimes measured in the same run: (label, decoder) pairs, each adds plain@label and
    # ours@label (its config's draft length); their outputs are checked against their own plain
    compare: Sequence[tuple[str, Any]] = ()
    # other proposers on the primary runtime: (label, proposer section) pairs, one method each
    methods: Sequence[tuple[str, dict]] = ()
    # cross-request memory of proposers that have one (suffix's global index): "independent"
    # clears it before every prompt; "sequence" keeps it across the prompts of a run, in file
    # order (runs then go outermost), so each request sees the ones before it
    memory: str = "independent"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")
        bad = [g for g in self.gammas if not (1 <= int(g) <= MAX_GAMMA)]
        if bad:
            raise ValueError(f"gammas must be integers in 1..{MAX_GAMMA}, got {bad[:5]}"
                             + (f" ... ({len(bad)} in all)" if len(bad) > 5 else ""))
        if self.cost_positions < 2:
            raise ValueError(f"cost_positions must be >= 2, got {self.cost_positions}")
        if self.memory not in ("independent", "sequence"):
            raise ValueError(f"memory must be independent or sequence, got {self.memory!r}")
        known = BASELINES.names()  # names only: a known peer's module is imported when it is built
        for name in self.baselines:
            if name not in known:  # refused with the options, before any model loads
                BASELINES.get(name)  # the registry's error: the unknown name and the registered ones

    def builtin_names(self) -> list[str]:
        """The names of the methods these options build on the primary runtime, for the CLI's check
        of ``--methods`` labels before any model loads (a peer that turns out unavailable is left out
        of the run, its name still reserved by ``check_labels``; ``Bench`` checks the names it built)."""
        names = list(dict.fromkeys(["plain", *self.baselines]))
        return names + [ours_name(int(g)) for g in dict.fromkeys(self.gammas)] + (["ours_auto"] if self.auto else [])

    def cost_width(self) -> int:
        """Positions the cost model measures: ``cost_positions``, or more where a fixed γ verifies
        γ+1 positions past them (its theoretical speedup divides by T(γ+1)/T(1))."""
        return max([self.cost_positions, *(int(g) + 1 for g in self.gammas)])


class RejectionCounter:
    """A round observer: which drafted tokens the verifier rejected (chains only)."""

    def __init__(self) -> None:
        self.rejected: Counter[int] = Counter()

    def observe(self, record: RoundRecord) -> None:
        d = record.draft
        if d is None or not isinstance(d.parents, tuple) or any(p != i - 1 for i, p in enumerate(d.parents)):
            return  # nothing drafted, or a tree (no single rejected token)
        toks = d.tokens.tolist()
        for b, (acc, n) in enumerate(zip(record.accepted, record.drafted())):
            if len(acc) < n:
                self.rejected[toks[b][len(acc)]] += 1


class _TracedDecoder(SpeculativeDecoder):
    """Keeps the draft policy of the last generation (to report what ``auto`` chose)."""

    last_policy: Any = None

    def policy(self) -> DraftPolicy:
        self.last_policy = super().policy()
        return self.last_policy

    @property
    def chosen(self) -> list[int]:
        """Rounds per draft length of the last generation (``auto``; empty for a fixed length)."""
        length = self.last_policy.length if self.last_policy is not None else None
        return list(length.chosen) if isinstance(length, AutoDraftLength) else []


@dataclass
class Method:
    name: str
    kind: str  # "baseline", "ours", or "compare" (plain / ours on another runtime)
    gamma: int | str | None
    run_turn: TurnFn
    recorder: RejectionCounter | None = None
    decoder: _TracedDecoder | None = None
    chosen_k: Counter = field(default_factory=Counter)  # auto: how often each gamma was picked
    group: str = ""  # runtime label for "compare" methods; "" = the primary runtime


@dataclass
class PromptRun:
    """One method on one prompt in one run: per-turn tokens, total seconds, merged stats."""

    tokens: list[list[int]]
    seconds: float
    stats: DecodeStats | None

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


class Bench:
    """Holds one decoder (one loaded runtime) and the methods built around it."""

    def __init__(self, decoder: SpeculativeDecoder, options: BenchOptions,
                 log: Callable[[str], None] | None = None) -> None:
        if decoder.config is None or decoder.config.proposer is None:
            raise ValueError("the bench needs a config with a proposer section (ours is measured against plain)")
        if decoder.tokenizer is None:
            raise ValueError("the bench needs a tokenizer on the target runtime to encode text prompts")
        self.decoder = decoder
        self.options = options
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.unavailable: dict[str, str] = {}
        self.costs = decoder.costs  # the primary runtime's, measured once for every method on it
        self.methods = self._build_methods()

    def _traced(self, proposer: Any, cfg: Any) -> _TracedDecoder:
        """A method's decoder on the primary runtime, sharing its measured costs."""
        dec = self.decoder
        traced = _TracedDecoder(dec.target, proposer, dec.verifier, cfg, dec.tokenizer, costs=self.costs)
        self.costs = traced.costs if traced.costs is not None else self.costs
        return traced

    # ---- setup -------------------------------------------------------------------------------
    def _gamma_for_peers(self) -> int:
        if self.options.baseline_gamma is not None:
            return self.options.baseline_gamma
        k = self.decoder.config.proposer.num_draft_tokens
        return int(k) if k != "auto" else 5

    def _build_methods(self) -> list[Method]:
        opts, dec = self.options, self.decoder
        names = list(dict.fromkeys(["plain", *opts.baselines]))  # plain is the reference, always first
        ctx = BaselineContext(dec, self._gamma_for_peers(), tuple(dec.eos_ids()))
        methods: list[Method] = []
        for name in names:
            factory = BASELINES.get(name)  # unknown names fail here with the registered list
            try:
                if drafts(factory) and ctx.num_draft_tokens < 1:
                    # a peer given draft length 0 fails only in its first decode (transformers)
                    raise BaselineUnavailable(
                        f"the config's num_draft_tokens is {ctx.num_draft_tokens} (no drafting), which leaves this "
                        "peer no draft length; give --baseline-gamma N to run it")
                methods.append(Method(name, "baseline", ctx.num_draft_tokens if drafts(factory) else None,
                                      factory(ctx)))
            except BaselineUnavailable as exc:
                if name == "plain":
                    raise
                self.unavailable[name] = str(exc)
                self.log(f"baseline {name!r} skipped: {exc}")
        variants: list[int | str] = [int(g) for g in dict.fromkeys(opts.gammas)]
        if opts.auto:
            variants.append("auto")
        if not variants:
            variants.append(dec.config.proposer.num_draft_tokens)
        for g in variants:
            cfg = dec.config.model_copy(
                update={"proposer": dec.config.proposer.model_copy(update={"num_draft_tokens": g})})
            rec = RejectionCounter()
            # a proposer with cross-request memory is not shared: one method must not see another's requests
            prop = self._proposer(cfg.proposer) if ProposerTraits.of(dec.proposer).remembers else dec.proposer
            traced = self._traced(prop, cfg)
            methods.append(Method(ours_name(g), "ours", g, _bind(traced, rec), rec, traced))
        check_labels([lab for lab, _ in opts.methods], [m.name for m in methods])
        for label, section in opts.methods:
            methods.append(self._extra_method(label, section))
        for label, other in opts.compare:
            methods += self._compare_methods(label, other)
        return methods

    def _proposer(self, section: Any) -> Any:
        from spec_plugins.registry import PROPOSERS

        dec = self.decoder
        return PROPOSERS.get(section.type)(section, target=dec.target, tokenizer=dec.tokenizer)

    def _extra_method(self, label: str, section: dict) -> Method:
        """Another proposer on the primary runtime, with its own draft length (``--methods``)."""
        dec = self.decoder
        cfg = method_config(dec.config, section, f"method {label!r}")
        rec = RejectionCounter()
        traced = self._traced(self._proposer(cfg.proposer), cfg)
        return Method(label, "method", cfg.proposer.num_draft_tokens, _bind(traced, rec), rec, traced)

    def _forget(self) -> None:
        """Clear every method's cross-request memory."""
        for m in self.methods:
            prop = m.decoder.proposer if m.decoder is not None else None
            if prop is not None and ProposerTraits.of(prop).remembers:
                prop.forget()

    def _compare_methods(self, label: str, other: SpeculativeDecoder) -> list[Method]:
        """plain@label and ours@label on another loaded runtime (same tokenizer required)."""
        if other.config is None or other.config.proposer is None:
            raise ValueError(f"compare config {label!r} has no proposer section")
        mine, theirs = self.decoder.tokenizer, other.tokenizer
        if theirs is None or mine.get_vocab() != theirs.get_vocab():
            raise ValueError(f"compare config {label!r}: its tokenizer differs from the primary config's; "
                             "the bench feeds every method the same token ids")
        check_compare_sampling(self.decoder.config, other.config, f"compare config {label!r}")
        g = other.config.proposer.num_draft_tokens
        plain_dec = other.without_speculation()
        rec = RejectionCounter()
        traced = _TracedDecoder(other.target, other.proposer, other.verifier, other.config, other.tokenizer,
                                costs=other.costs)
        return [Method(f"plain@{label}", "compare", None, lambda ids, n: time_decoder(plain_dec, ids, n),
                       group=label),
                Method(f"{ours_name(g)}@{label}", "compare", g, _bind(traced, rec), rec, traced, group=label)]

    # ---- prompts -----------------------------------------------------------------------------
    def _encode(self, history: list[dict]) -> list[int]:
        return encode_history(self.decoder, history, self.options.chat)

    def _run_prompt(self, method: Method, prompt: BenchPrompt, max_new: int) -> PromptRun:
        history: list[dict] = []
        toks: list[list[int]] = []
        seconds = 0.0
        stats: DecodeStats | None = None
        for turn in prompt.turns:
            history.append({"role": "user", "content": turn})
            ids = self._encode(history)
            r: TurnRun = method.run_turn(ids, max_new)
            if method.decoder is not None:
                for k, c in enumerate(method.decoder.chosen):
                    if c:
                        method.chosen_k[k] += c
            toks.append(r.tokens)
            seconds += r.seconds
            if r.stats is not None:
                stats = r.stats if stats is None else stats.merge(r.stats)
            answer = self.decoder.tokenizer.decode(r.tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
        return PromptRun(toks, seconds, stats)

    def _mismatches(self, p: BenchPrompt, runs: dict[str, list[PromptRun]]) -> list[dict]:
        """Greedy identity on one prompt: every run of every method against run 0 of its reference
        (a runtime's methods against its own plain, each runtime's plain against the primary plain,
        the primary plain's later runs against its run 0), so a method that drifts in a later run,
        or whose state carries across runs, is caught too."""
        out = []
        for m in self.methods:
            ref_name = plain_of(m.group) if m.name != plain_of(m.group) else "plain"
            ref = runs[ref_name][0].tokens
            for r, got in enumerate(runs[m.name]):
                if (m.name, r) == (ref_name, 0) or got.tokens == ref:
                    continue
                out.append({**_mismatch(p, m.name, ref, got.tokens), "reference": ref_name, "run": r})
        return out

    # ---- the run -----------------------------------------------------------------------------
    def run(self, prompts: Sequence[BenchPrompt], partial: Any = None) -> dict:
        """Measure everything; returns the raw results (``report.build_report`` summarises).
        ``partial``: a path that gets one JSON line per finished prompt (survives an interrupted run)."""
        import json
        from tqdm import tqdm

        from spec_plugins.policy import Costs
        from spec_plugins.sampling import LogitsPipeline

        check_prompts(prompts)
        opts = self.options
        t_start = time.perf_counter()
        pipeline = LogitsPipeline(self.decoder._sampling(None, None))
        costs = self.costs
        width = opts.cost_width()
        if costs is None or not costs.covers((1,), width):
            self.log(f"measuring the cost model (target forward over 1..{width} positions) ...")
            costs = Costs.measure(self.decoder.target, max_positions=width)
        model = costs.forward.base
        draft = costs.measure_drafter(self.decoder.proposer, self.decoder.target, pipeline)
        t1 = model(1, 1)
        cost = {**model.to_dict(), "draft_round_seconds": draft.per_call, "draft_step_seconds": draft.per_token,
                "draft_cost_ratio": draft.per_token / t1}
        if opts.warmup:
            for m in self.methods:  # first calls pay one-off setup (allocator, HF generate init)
                self._run_prompt(m, BenchPrompt("warmup", "warmup", prompts[0].turns[:1]), min(16, opts.max_new_tokens))
                m.chosen_k.clear()
                if m.recorder is not None:
                    m.recorder.rejected.clear()
        results: dict[str, list[list[PromptRun]]] = {m.name: [[] for _ in prompts] for m in self.methods}
        bar = tqdm(total=len(prompts) * opts.runs * len(self.methods), desc="bench", unit="gen",
                   disable=not opts.progress, file=sys.stderr, dynamic_ncols=True)
        mismatches: list[dict] = []
        greedy = pipeline.greedy
        order = ([(i, r) for r in range(opts.runs) for i in range(len(prompts))] if opts.memory == "sequence"
                 else [(i, r) for i in range(len(prompts)) for r in range(opts.runs)])
        for i, r in order:
            p = prompts[i]
            if opts.memory == "independent" or i == 0:
                self._forget()
            shift = r % len(self.methods)
            for m in self.methods[shift:] + self.methods[:shift]:
                bar.set_postfix_str(f"{p.question_id} {m.name}", refresh=False)
                results[m.name][i].append(self._run_prompt(m, p, opts.max_new_tokens))
                bar.update(1)
            if r != opts.runs - 1:
                continue
            if partial is not None:
                line = {"question_id": p.question_id, "category": p.category,
                        "methods": {m.name: {"seconds": [r.seconds for r in results[m.name][i]],
                                             "new_tokens": [r.new_tokens for r in results[m.name][i]]}
                                    for m in self.methods}}
                with open(partial, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
            if greedy:
                for mm in self._mismatches(p, {m.name: results[m.name][i] for m in self.methods}):
                    mismatches.append(mm)
                    bar.write(f"GREEDY MISMATCH: {mm['method']} differs from {mm['reference']} on {p.question_id} "
                              f"(run {mm['run']}, turn {mm['turn']}, token {mm['index']})", file=sys.stderr)
        bar.close()
        mismatches.sort(key=lambda mm: [q.question_id for q in prompts].index(mm["question_id"]))
        return {
            "prompts": list(prompts),
            "methods": self.methods,
            "results": results,
            "mismatches": mismatches,
            "greedy": greedy,
            "cost_model": cost,
            "kernels": getattr(self.decoder.target, "kernels", None),
            "unavailable": dict(self.unavailable),
            "duration_s": time.perf_counter() - t_start,
        }


def encode_history(decoder: SpeculativeDecoder, history: list[dict], chat: bool) -> list[int]:
    """A turn's prompt ids: the chat template over the history when ``chat`` (``--raw`` off) and the
    model has one, else the turns' texts joined; the replay re-encodes a report's prompts with it."""
    if chat and decoder.has_chat_template:
        return decoder.encode(history)
    return decoder.encode("\n\n".join(m["content"] for m in history))


def _bind(decoder: SpeculativeDecoder, counter: RejectionCounter) -> TurnFn:
    return lambda ids, n: time_decoder(decoder, ids, n, observers=(counter,))


def _mismatch(p: BenchPrompt, method: str, ref: list[list[int]], got: list[list[int]]) -> dict:
    """Where a method's greedy output first leaves plain's: turn and token index."""
    for t, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            idx = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"question_id": p.question_id, "method": method, "turn": t, "index": idx}
    return {"question_id": p.question_id, "method": method, "turn": len(ref), "index": 0}

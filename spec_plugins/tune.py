"""``spec-plugins tune``: the fastest exact configuration for this machine, model and prompts.

1. Each runtime is built once: its verify-cost curve T(N) is measured (``policy.cost``) and it
   decodes the user's prompts plainly (greedy, short answers), timed: its plain speed, and the
   outputs each proposer will be scored against.
2. Proposers whose drafts read only the sequence (n-gram, suffix) are scored without decoding
   again: the real round replays each runtime's recorded outputs (``tune_replay``), charging the
   runtime's measured costs, for ``auto`` and every fixed draft length. Their sections fix the
   tree's node count: the replay cannot reproduce an ``auto`` tree's cut, so the section replayed
   is the one confirmed and written (``tune_replay.replay_factory``). The others (of tune's
   ``PROPOSERS``: EAGLE) read the target's hidden states or logits, which a replay does not have,
   so they run for real, briefly; feature drafters only on runtimes that return them.
3. The predicted best few are confirmed by a short interleaved run against plain decoding on the
   fastest runtime; the fastest measured one wins if it beats plain by more than ``noise``,
   otherwise the plain configuration is written. A lossy verifier is never chosen.

The budget bounds what ``BUDGET_BOUNDS`` says (tune's --help), checked between prompts and stages.

The written YAML (``tune_yaml.render_yaml``) carries the measured numbers and the command in its
comments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from spec_plugins.tune_budget import (  # noqa: F401 (tune_cli and tests import these from here)
    MAX_BUDGET_SECONDS,
    Budget,
    TuneError,
    _spent,
    parse_budget,
)
from spec_plugins.tune_replay import (  # tune's replay predictions (_replay: callers import it from here)
    _replay,  # noqa: F401
    _replay_counted,
    needs_features,
    replay_factory,
    replayable,
)

RUNTIMES = {  # label -> target section fields (besides the model)
    "torch": {"backend": "torch", "dtype": "float32"},
    "onnxruntime": {"backend": "onnxruntime"},
    "onnxruntime-int8": {"backend": "onnxruntime", "quantize": "int8"},
    # the GGUF's own 4-bit blocks carried into ONNX Runtime (perplexity within 1 % of fp32 here)
    "onnxruntime-int4": {"backend": "onnxruntime", "quantize": "int4", "quant_grid": "gguf"},
    "llamacpp": {"backend": "llamacpp"},
}
PROPOSERS = {  # label -> proposer section
    "ngram": {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3},
    # a fixed tree_nodes: replayed, confirmed and written alike (module docstring, step 2)
    "suffix": {"type": "suffix", "num_draft_tokens": 16, "tree_nodes": 16, "scope": "request"},
    "eagle": {"type": "eagle", "heads": "examples/heads/smollm2-135m-instruct/eagle", "mode": "tree",
              "num_draft_tokens": 6, "tree_nodes": "auto"},
}
INSTALL = {"onnxruntime": ("onnxruntime", "pip install -e '.[onnx]'"),
           "llamacpp": ("llama_cpp", "pip install -e '.[llamacpp]' (see the README for the CPU build flags)")}


BUDGET_BOUNDS = ("It bounds the runtimes after the first, the feature drafters, the predictions confirmed after the "
                 "best, and each plain decoding, replay and confirmation pass after its first prompt (what it cuts is "
                 "noted in the YAML); loading the first runtime, measuring its verify cost and one prompt of each pass "
                 "always run.")


@dataclass
class Measured:
    label: str
    runtime: str
    proposer: str | None
    draft: int | str | None
    tokens_per_s: float
    predicted: float | None = None
    mean_accepted: float | None = None


def _needs_gguf(runtime: str) -> bool:
    """llama.cpp and the GGUF-grid int4 export read the model's GGUF file itself, not only its weights."""
    fields = RUNTIMES[runtime]
    return fields["backend"] == "llamacpp" or fields.get("quant_grid") == "gguf"


def unavailable(runtime: str, model: str | None = None) -> str | None:
    """Why ``runtime`` cannot run here (its package is missing or fails to import) or cannot run
    ``model``; None if it can (``model`` None: only the package is checked)."""
    import importlib.util

    from spec_plugins.models import resolve_model

    mod, hint = INSTALL.get(runtime.split("-")[0], (None, ""))
    if mod is not None and importlib.util.find_spec(mod) is None:
        return f"is not installed: {hint}"
    if mod is not None and (why := _import_failure(mod)) is not None:
        return f"is installed but its package {mod} fails to import ({why}); reinstall it: {hint}"
    if model is None or not _needs_gguf(runtime):
        return None
    gguf_path = resolve_model(model).gguf_path
    if gguf_path is None:
        return f"needs a GGUF model (it reads the GGUF file itself); {model!r} is a transformers directory"
    if RUNTIMES[runtime].get("quant_grid") == "gguf":
        from spec_plugins.exporters.onnx_quantize import CARRIED, gguf_block_types

        if not gguf_block_types(gguf_path) & CARRIED:
            return f"carries the GGUF's {' and '.join(sorted(CARRIED))} blocks; {model!r} holds none"
    return None


def _import_failure(module: str) -> str | None:
    """Why importing ``module`` fails (a broken install: a shared library that does not load, a
    missing system library, one built for another version), checked before any runtime is
    measured so that a build later cannot fail on it; None when it imports."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # a third-party import may raise anything (ctypes: AttributeError)
        return f"{type(exc).__name__}: {exc}"
    return None


def default_runtimes(model: str) -> tuple[list[str], dict[str, str]]:
    """The runtimes that can run ``model`` here (tune's default), and why each other one cannot."""
    why = {r: reason for r in RUNTIMES if (reason := unavailable(r, model)) is not None}
    return [r for r in RUNTIMES if r not in why], why


def check_choices(runtimes: Sequence[str], proposers: Sequence[str], model: str | None = None) -> None:
    """Unknown or repeated names, runtimes that are not installed and runtimes that cannot run
    ``model`` fail before any model loads (``model`` None: it is not checked)."""
    for kind, names in (("runtime", runtimes), ("proposer", proposers)):
        if (repeat := next((n for i, n in enumerate(names) if n in names[:i]), None)) is not None:
            raise TuneError(f"{kind} {repeat!r} is named more than once; name each {kind} once")
    for r in runtimes:
        if r not in RUNTIMES:
            raise TuneError(f"unknown runtime {r!r}; allowed values: {', '.join(RUNTIMES)}")
        reason = unavailable(r, model)
        if reason is not None:
            raise TuneError(f"runtime {r!r} {reason}")
    for p in proposers:
        if p not in PROPOSERS:
            raise TuneError(f"unknown proposer {p!r}; allowed values: {', '.join(PROPOSERS)}")
    if not runtimes or not proposers:
        raise TuneError("tune needs at least one runtime and one proposer")


def model_reference(model: str) -> str:
    """``model`` as the written config names it: an existing local path made absolute, so the
    config loads from any directory; a built-in name (which ``resolve_model`` takes first) as given."""
    from spec_plugins.models import BUILTIN_MODELS

    path = Path(model).expanduser()
    return model if model in BUILTIN_MODELS or not path.exists() else str(path.resolve())


def _note(notes: list[str], log: Callable[[str], None], text: str) -> None:
    """Something the written YAML must say (a candidate left out or cut short), also logged."""
    notes.append(text)
    log(f"[tune] {text}")


def _skipped(notes: list[str], log: Callable[[str], None], what: str) -> None:
    """A candidate left unmeasured (the budget is spent), in the written notes and in the log."""
    _note(notes, log, f"{what} skipped: budget spent")


def _cut(notes: list[str], log: Callable[[str], None], what: str, done: int, total: int, unit: str) -> None:
    """A pass the budget stopped early: how much of it ran, in the notes and the log."""
    if done < total:
        _note(notes, log, f"{what} cut to {done} of {total} {unit}: budget spent")


def _decoder(model: str, runtime: str, proposer: str | None, target: Any = None, draft: int | str | None = None,
             costs: Any = None) -> Any:
    """A decoder of the candidate (``draft``: its draft length instead of the default section's),
    on ``target`` and its measured ``costs`` when given."""
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    section = dict(PROPOSERS[proposer]) if proposer else None
    if section is not None and draft is not None and "num_draft_tokens" in section:
        section["num_draft_tokens"] = draft
    cfg = SpecConfig.parse({"target": {**RUNTIMES[runtime], "model": model}, "proposer": section})
    return SpeculativeDecoder.from_config(cfg, target=target, costs=costs)


def _measure_costs(target: Any) -> Any:
    """The runtime's verify costs of 1..17 positions (``policy.Costs``) after ``DEFAULTS.context``
    tokens, or after as many as fit beside them in a shorter context; a context with no room for
    even one token before them is a TuneError naming the minimum."""
    from spec_plugins.policy import DEFAULTS, Costs

    positions = DEFAULTS.max_k + 1
    context = min(DEFAULTS.context, target.max_context - positions)
    if context < 1:
        raise TuneError(f"tune measures forwards of up to {positions} positions after at least one token of "
                        f"context, so it needs a context of at least {positions + 1} positions; this runtime's "
                        f"holds {target.max_context}")
    return Costs.measure(target, max_positions=positions, context=context)


def _check_fit(ids: Sequence[list[int]], names: Sequence[str] | None, max_new: int, rt: str, context: int) -> None:
    """Every prompt and its answer must fit the runtime's context, checked before it is measured:
    the decode loop refuses one that does not as its batch's "request 0", whichever prompt it is."""
    for i, p in enumerate(ids):
        if len(p) + max_new > context:
            raise TuneError(f"{names[i] if names else f'prompts[{i}]'}: a prompt of {len(p)} tokens plus "
                            f"--max-new-tokens {max_new} runs past the context of {context} positions on runtime "
                            f"{rt}: lower --max-new-tokens or shorten the prompt")


def _plain_outputs(dec: Any, prompts: Sequence[list[int]], max_new: int, budget: Budget | None = None
                   ) -> tuple[list[list[int]], float]:
    """Greedy outputs of the first prompts (all, or as many as ``budget`` allows, at least one) and
    plain tokens/s on this runtime."""
    from spec_plugins.bench.baselines import time_decoder

    plain = dec.without_speculation()
    time_decoder(plain, prompts[0], min(8, max_new))  # warm-up, within what every prompt was checked for
    outs, secs, n = [], 0.0, 0
    for p in prompts:
        if outs and _spent(budget):
            break
        r = time_decoder(plain, p, max_new)
        outs.append(r.tokens)
        secs += r.seconds
        n += len(r.tokens)
    return outs, n / secs


def _interleaved(decoders: dict[str, Any], prompts: Sequence[list[int]], max_new: int, rounds: int = 2,
                 budget: Budget | None = None) -> tuple[dict[str, tuple[float, float | None]], int]:
    """tokens/s and mean accepted tokens of each decoder, runs interleaved (A B C, B C A, ...); and
    how many of the ``rounds`` x prompts runs took place (every decoder on each; as many as
    ``budget`` allows, at least one)."""
    from spec_plugins.bench.baselines import time_decoder

    names = list(decoders)
    acc = {k: [0, 0.0, 0, 0] for k in names}  # tokens, seconds, emitted, forwards
    done = 0
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for p in prompts:
            if done and _spent(budget):
                break
            done += 1
            for k in order:
                run = time_decoder(decoders[k], p, max_new)
                a = acc[k]
                a[0] += len(run.tokens)
                a[1] += run.seconds
                if run.stats is not None:
                    a[2] += run.stats.emitted_tokens
                    a[3] += run.stats.target_forwards
    return {k: (a[0] / a[1], a[2] / a[3] if a[3] else None) for k, a in acc.items()}, done


@dataclass
class TuneResult:
    chosen: Measured
    plain: Measured
    measured: list[Measured]
    runtimes: dict[str, dict[str, Any]]  # label -> plain tok/s, cost curve
    config: dict[str, Any]
    seconds: float
    notes: list[str] = field(default_factory=list)


def tune(model: str, prompts: Sequence[str], runtimes: Sequence[str] | None, proposers: Sequence[str],
         budget: Budget, max_new: int = 64, confirm: int = 3, noise: float = 0.03,
         log: Callable[[str], None] = print, names: Sequence[str] | None = None) -> TuneResult:
    """Measure, predict, confirm (module docstring); returns what to write. ``runtimes`` None:
    every one that can run ``model`` here; those left out are logged and noted with why.
    ``names``: each prompt as errors name it (default ``prompts[i]``)."""
    notes: list[str] = []
    model = model_reference(model)
    by_default = runtimes is None
    left_out: dict[str, str] = {}  # runtime -> why tune's default left it out
    if runtimes is None:
        runtimes, why_not = default_runtimes(model)
        for rt, why in why_not.items():
            left_out[rt] = f"it {why}"
            _note(notes, log, f"runtime {rt} left out: it {why}")
    check_choices(runtimes, proposers, model)
    if not prompts:
        raise TuneError("no prompts to tune on")
    if names is not None and len(names) != len(prompts):
        raise TuneError(f"{len(names)} prompt names for {len(prompts)} prompts: give one name each")
    t0 = time.perf_counter()
    built: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    candidates: list[Measured] = []
    for rt in runtimes:  # 1. each runtime: cost curve, plain speed, outputs
        if budget.left <= 0 and built:
            _skipped(notes, log, f"runtime {rt}")
            continue
        log(f"[tune] {rt}: loading, measuring the verify cost and plain decoding ...")
        try:
            dec = _decoder(model, rt, None)
        except (ValueError, FileNotFoundError) as exc:  # e.g. a GGUF the int4 grid cannot carry whole
            if not by_default:
                raise TuneError(f"runtime {rt} cannot run {model!r}: {exc}") from exc
            left_out[rt] = str(exc)
            _note(notes, log, f"runtime {rt} left out: {exc}")
            continue
        ids = [dec.encode([{"role": "user", "content": p}]) if dec.has_chat_template else dec.encode(p)
               for p in prompts]
        try:
            _check_fit(ids, names, max_new, rt, dec.target.max_context)
        except TuneError as exc:  # a default runtime with a shorter context: the others still tune
            if not by_default:
                raise
            left_out[rt] = str(exc)
            _note(notes, log, f"runtime {rt} left out: {exc}")
            continue
        costs = _measure_costs(dec.target)
        cost = costs.forward.base
        outs, plain_tps = _plain_outputs(dec, ids, max_new, budget)
        _cut(notes, log, f"plain decoding on {rt}", len(outs), len(ids), "prompts")
        built[rt] = (dec, ids, outs, costs)
        info[rt] = {"plain_tokens_per_s": round(plain_tps, 2), "t1_ms": round(cost(1, 1) * 1e3, 2),
                    "cost_relative": [round(x, 3) for x in cost.relative()[:17]], "prompts": len(outs)}
        # 2. model-free proposers: replay this runtime's outputs at its measured costs
        for p in proposers:
            if not replayable(PROPOSERS[p]):
                continue
            sim, done = _replay_counted(ids, outs, replay_factory(PROPOSERS[p]), cost, overhead=0.3e-3,
                                        vocab=dec.target.vocab_size, budget=budget, max_new=max_new,
                                        eos_ids=dec.eos_ids())
            _cut(notes, log, f"{p} replay on {rt}", done, len(outs), "decoded prompts")
            best = max((k for k in sim if k != "plain"), key=lambda k: sim[k])
            ratio = sim[best] / sim["plain"]
            candidates.append(Measured(f"{rt}+{p}", rt, p, best if best == "auto" else int(best), 0.0,
                                       predicted=plain_tps * ratio))
            log(f"[tune]   {p}: predicted {plain_tps * ratio:.1f} tok/s ({ratio:.2f}x plain, draft {best})")
    if not info:  # tune's default runtimes, every one left out (a named one that fails raised above)
        whys = "; ".join(f"{rt} left out: {why}" for rt, why in left_out.items())
        raise TuneError(f"no runtime can run {model!r} here ({whys})")
    fastest = max(info, key=lambda r: info[r]["plain_tokens_per_s"])
    for p in proposers:  # the others: a short real run (feature drafters where hidden states exist)
        if replayable(PROPOSERS[p]):
            continue
        for rt, (dec, ids, outs, costs) in built.items():
            if needs_features(PROPOSERS[p]) and not dec.target.capabilities.hidden_states:
                _note(notes, log, f"{p} on {rt} not measured: the runtime returns no hidden states")
                continue
            if budget.left <= 0:
                _skipped(notes, log, f"{p} on {rt}")
                continue
            try:
                d = _decoder(model, rt, p, target=dec.target, costs=costs)
            except (ValueError, FileNotFoundError) as exc:
                _note(notes, log, f"{p} on {rt} not measured: {exc}")
                continue
            got, done = _interleaved({"x": d}, ids[:2], max_new, rounds=1, budget=budget)
            _cut(notes, log, f"{p} on {rt}", done, len(ids[:2]), "prompts")
            tps, mean = got["x"]
            candidates.append(Measured(f"{rt}+{p}", rt, p, PROPOSERS[p].get("num_draft_tokens"), 0.0, predicted=tps,
                                       mean_accepted=mean))
            log(f"[tune]   {p} on {rt}: {tps:.1f} tok/s measured briefly")
    # 3. confirm the best predictions against plain decoding on the fastest runtime
    candidates.sort(key=lambda m: m.predicted or 0.0, reverse=True)
    top = candidates[:confirm]
    dec_f, ids_f = built[fastest][0], built[fastest][1]
    decs = {"plain@" + fastest: dec_f.without_speculation()}
    for i, m in enumerate(top):  # building one may measure its costs again (a tree's widths): bounded
        if i and budget.left <= 0:
            _cut(notes, log, "confirmation", i, len(top), "best predictions")
            top = top[:i]
            break
        dec, costs = built[m.runtime][0], built[m.runtime][3]
        draft = m.draft if replayable(PROPOSERS[m.proposer]) else None
        decs[m.label] = _decoder(model, m.runtime, m.proposer, target=dec.target, draft=draft, costs=costs)
    log(f"[tune] confirming {', '.join(decs)} (interleaved) ...")
    confirm_ids = ids_f[: max(2, min(4, len(ids_f)))]
    got, done = _interleaved(decs, confirm_ids, max_new, budget=budget)
    _cut(notes, log, "confirmation", done, 2 * len(confirm_ids), "interleaved prompt runs")
    plain = Measured("plain@" + fastest, fastest, None, None, got["plain@" + fastest][0])
    for m in top:
        m.tokens_per_s, m.mean_accepted = got[m.label]
    best = max(top, key=lambda m: m.tokens_per_s) if top else plain
    chosen = best if best.tokens_per_s > plain.tokens_per_s * (1 + noise) else plain
    if not candidates:
        notes.append("no speculative configuration was measured (see the notes above): writing plain")
    elif chosen is plain:
        notes.append(f"no speculative configuration beat plain decoding by more than {noise:.0%}: writing plain")
    section = {**RUNTIMES[chosen.runtime], "model": model}
    prop = None
    if chosen.proposer is not None:
        prop = dict(PROPOSERS[chosen.proposer])
        if "num_draft_tokens" in prop and chosen.draft is not None:
            prop["num_draft_tokens"] = chosen.draft
    config = {"target": section, "proposer": prop, "verifier": {"type": "exact"},
              "sampling": {"temperature": 0.0, "seed": 0}}
    return TuneResult(chosen, plain, candidates, info, config, time.perf_counter() - t0, notes)

"""Parity of exported graphs with their PyTorch modules (``spec-plugins export check DIR``).

Three checks per decoder graph (target verify graph, draft model graph):
1. random inputs straight into the session: N = 1..gamma+1 new nodes, chain and tree masks,
   non-empty past, B = 2;
2. real inputs through the two runtimes (TorchRuntime vs OnnxRuntime): a real prompt, a
   left-padded batch, chains and a tree with commit/rollback between them;
3. greedy speculative decoding (n-gram drafts) on both runtimes: the tokens must be identical.
Steps 1 and 2 compare the logits, the hidden states and (a graph with feature layers) the features,
which the Medusa / EAGLE / EAGLE-3 drafters on ONNX Runtime read. Every comparison goes through
:func:`compare`: max |ort - torch| relative to max |torch|, held to a tolerance set by the graph's
dtype (:data:`RTOL`; on real inputs :data:`REAL_RTOL`) unless one is given.

A quantized graph (``export onnx --quantize``) is not the fp32 model, so its outputs on real inputs
(step 2) are held to ``rtol`` if one is given, else to its bits' bound (:func:`quant_rtol`) against
its fp32 source (another model's weights miss it; at 8 bits, one projection's weights lost too),
and its logits' scale (the temperature it samples at) to :data:`QUANT_SCALE_BOUND`; on random
inputs (step 1) the error is reported, not held; step 3 holds it to its own standard: greedy speculative decoding on the quantized graph must
equal plain greedy decoding on it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from spec_plugins.exporters.parity_greedy import GreedyCase, first_diff, greedy_room, greedy_tokens
from spec_plugins.exporters.parity_plan import RANDOM_PAST, RuntimePlan, check_gamma, random_tree
from spec_plugins.exporters.parity_rule import RTOL, ParityCase, compare, compare_scale
from spec_plugins.graphs.manifest import Manifest

# A quantized graph against its fp32 source on real inputs: max |diff| <= rtol * max |fp32 logits|, by
# the scheme's bits (:func:`quant_rtol`). QUANT_RTOL, for 4 bits (and a scheme that names none), is
# loose enough for re-quantizing onto a new 4-bit grid and below another model's weights; 8-bit
# rounding is several times finer, so its bound also catches one projection's weights lost, which
# the 4-bit bound passes (the measurements that place both are in docs/runtimes/onnxruntime.md).
# Random ids over a random past drive activation quantization out of its range, so those cases are
# reported, not held.
QUANT_RTOL = 0.75
QUANT_RTOL_BITS = {4: QUANT_RTOL, 8: 0.2}  # at QUANT_BLOCK weights a block (the default); larger: quant_rtol
QUANT_BLOCK = 32
# On real inputs float16 rounding stays far below the random-past cases' share (at most 1.3e-3 of the
# scale on nine tiny families, 2-3e-3 on SmolLM2-135M), so those cases are held to a bound of their
# own, which logits scaled by a constant (a baked-in temperature: 0.15 off at x0.85) miss.
REAL_RTOL = {"float32": 1e-4, "float16": 2e-2}
# A quantized graph's logit scale against its fp32 source's on real inputs (``compare_scale``: the
# temperature it samples at) within this factor of 1: honest schemes measured 0.82..1.006 (int4
# re-quantized the lowest), logits halved 0.5. The distance of the probabilities themselves cannot
# serve: it grows with how peaked a model's distributions are (halved logits of a tiny model moved
# them 0.065, SmolLM2's honest int4 0.11 to 0.44).
QUANT_SCALE_BOUND = 1.5
_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again, and"


@dataclass
class ParityReport:
    directory: str
    tolerances: dict[str, float] = field(default_factory=dict)  # graph name -> rtol it was held to
    real_tolerances: dict[str, float] = field(default_factory=dict)  # decoder graph -> rtol on real inputs
    quantized: list[str] = field(default_factory=list)  # graphs compared with their fp32 source
    cases: list[ParityCase] = field(default_factory=list)
    greedy: list[GreedyCase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases) and all(g.identical for g in self.greedy)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for c, dc in zip(self.cases, d["cases"]):
            dc["rel"] = c.rel
        d["max_abs"] = max((c.max_abs for c in self.cases), default=0.0)
        d["max_rel"] = max((c.rel for c in self.cases), default=0.0)
        quant = [c for c in self.cases if c.graph in self.quantized and c.output == "logits"]
        if quant:  # the logit error of quantized graphs against fp32
            d["quantized_max_rel"] = max(c.rel for c in quant)
        return _finite_or_null(d)

    def format(self) -> str:
        rtols = ", ".join(f"{g} {t:g}" + (f" (real inputs {self.real_tolerances[g]:g})" if
                                           self.real_tolerances.get(g, t) != t else "")
                          for g, t in self.tolerances.items())
        head = f"parity of {self.directory} (tolerance per output: max|diff| <= rtol x max|reference|; rtol {rtols})"
        lines = [head]
        for c in self.cases:
            mark = "info" if c.reported else ("ok  " if c.ok else "FAIL")
            lines.append(f"  {mark} {c.graph:<8} {c.case:<44} max|diff| {c.max_abs:.3e}  rel {c.rel:.2e}")
        for g in self.greedy:
            what = "identical" if g.identical else f"DIFFER at token {g.first_difference}"
            mark = "ok  " if g.identical else "FAIL"
            lines.append(f"  {mark} {g.graph:<8} greedy speculative, {g.tokens} tokens: {what}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def _finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (a shape mismatch's max|diff| is inf) as None, so the
    report is valid JSON (null); such a case carries ``ok: false`` and the shapes in its name."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(v) for v in value]
    return value


@torch.no_grad()
def check_random(graph: str, session: Any, model: Any, gamma: int, rtol: float, seed: int = 0,
                 past: int = RANDOM_PAST, feature_layers: Sequence[int] = ()) -> list[ParityCase]:
    """Random ids, random past, chain and tree masks, N = 1..gamma+1, fed to the session directly;
    the logits, the hidden states and (``feature_layers``) the features are each compared: the
    drafters on ONNX Runtime read the latter two."""
    from spec_plugins.exporters.onnx_verify import VerifyGraph, dummy_inputs
    from spec_plugins.graphs.io import DecoderShape, input_names
    from spec_plugins.tree import layout

    layers = tuple(feature_layers)
    wrapper = VerifyGraph(model, layers).eval()
    shape = DecoderShape.of(model)
    names = input_names(shape.num_layers)
    outputs = ["logits", "hidden", *(["features"] if layers else [])]
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    out = []
    for n in range(1, gamma + 2):
        for tree in (False, True):
            if tree and n < 3:
                continue  # one and two nodes can only form a chain
            anc = layout(random_tree(n, gen)).ancestors if tree else None
            args = dummy_inputs(shape, 2, n, past, dtype, anc, gen)
            want = wrapper(*args)
            got = session.run(outputs, {k: v.numpy() for k, v in zip(names, args)})
            label = f"random B=2 N={n} P={past} {'tree' if tree else 'chain'}"
            for name, g, w in zip(outputs, got, want):
                out.append(compare(graph, label + f" {name}" * (name != "logits"), g, w, rtol, output=name))
    return out


class _Pair:
    """The torch and the ONNX Runtime runtime driven through the same steps, each step's outputs
    compared: logits (and, ``scale_bound``, their scale: ``compare_scale``), and the hidden states
    or features the step asked for. Feature steps take turns with hidden-state steps, as one forward returns one."""

    def __init__(self, graph: str, torch_rt: Any, ort_rt: Any, rtol: float, scale_bound: float | None) -> None:
        self.graph, self.torch_rt, self.ort_rt = graph, torch_rt, ort_rt
        self.rtol, self.scale_bound = rtol, scale_bound
        self.layers = tuple(ort_rt.capabilities.feature_layers)
        self.cases: list[ParityCase] = []

    def want(self, i: int) -> Any:
        """The hidden output the i-th step asks for: the features on odd steps where the graph has them."""
        return self.layers if self.layers and i % 2 else True

    def step(self, label: str, call: Callable[[Any, Any], Any], want: Any, pad: Sequence[int] = (),
             logits: bool = True) -> None:
        """``call(runtime, want)`` on both runtimes; ``pad``: left padding per row, whose positions'
        hidden states are no token's and are left out; ``logits``: compare them too (not for a
        step that repeats one whose logits were compared)."""
        a, b = call(self.torch_rt, want), call(self.ort_rt, want)
        if logits:
            self.cases.append(compare(self.graph, label, b.logits, a.logits, self.rtol))
            if self.scale_bound is not None:
                self.cases.append(compare_scale(self.graph, label, b.logits, a.logits, self.scale_bound))
        name = "features" if isinstance(want, tuple) else "hidden"
        ha, hb = a.hidden, b.hidden
        if pad:
            ha, hb = (torch.cat([h[i, p:] for i, p in enumerate(pad)]) for h in (a.hidden, b.hidden))
        self.cases.append(compare(self.graph, f"{label} {name}", hb, ha, self.rtol, output=name))

    def both(self, method: str, *args: Any) -> None:
        getattr(self.torch_rt, method)(*args)
        getattr(self.ort_rt, method)(*args)


@torch.no_grad()
def check_runtimes(graph: str, torch_rt: Any, ort_rt: Any, ids: list[int], gamma: int, rtol: float,
                   seed: int = 0, scale_bound: float | None = None) -> list[ParityCase]:
    """Real prompt ids through both runtimes: prefill (solo and left-padded batch), chains of
    N = 1..gamma+1 with partial commits, a tree with a path commit, a rollback (every random draw of
    them: ``RuntimePlan``). Each step compares the logits and the hidden states or features
    (``_Pair``); ``scale_bound``: also the logits' scale (a quantized graph against its float
    source, ``compare_scale``)."""
    from spec_plugins.tree import layout

    plan = RuntimePlan.draw(gamma, torch_rt.vocab_size, seed)
    pair = _Pair(graph, torch_rt, ort_rt, rtol, scale_bound)
    half = ids[: max(1, len(ids) // 2)]
    label = f"real prefill B=2 (left-padded, {len(ids)}/{len(half)} tokens)"
    for want in (True, pair.layers) if pair.layers else (True,):  # a prefill starts afresh: both on one prompt
        pair.step(label, lambda rt, w: rt.prefill([ids, half], want_hidden=w), want, pad=(0, len(ids) - len(half)),
                  logits=want is True)
    for n, (toks, keep) in enumerate(plan.chains, 1):
        toks[0] = torch.tensor([ids[i % len(ids)] for i in range(n, 2 * n)])  # real continuation-like ids for row 0
        label = f"real chain B=2 N={n} P={torch_rt.lengths()[0]}"
        pair.step(label, lambda rt, w, t=toks: rt.forward(t, want_hidden=w), pair.want(n))
        pair.both("commit", [list(range(k)) for k in keep])
    lay, toks = layout(plan.parents), plan.tree_tokens
    pair.step(f"real tree B=2 N={lay.size} (holes in past)", lambda rt, w: rt.forward(toks, tree=lay, want_hidden=w),
              pair.want(1))
    pair.both("commit", [plan.path(), [0]])
    pair.both("rollback", [max(1, L - 3) for L in torch_rt.lengths()])
    toks = plan.last_tokens
    pair.step("real chain after tree commit + rollback", lambda rt, w: rt.forward(toks, want_hidden=w), True)
    return pair.cases


def quant_rtol(quantization: dict) -> float:
    """The bound of a graph quantized as ``quantization`` (its manifest entry's) against fp32:
    :data:`QUANT_RTOL_BITS` by its bits, :data:`QUANT_RTOL` (the loosest) where they are not named.
    A block's activations are quantized together too (accuracy level 4), so the rounding grows with
    the block: past :data:`QUANT_BLOCK` weights a block, the 8-bit bound grows as the root of the
    block's share (capped at the loosest)."""
    rtol = QUANT_RTOL_BITS.get(quantization.get("bits"), QUANT_RTOL)
    block = quantization.get("block_size") or QUANT_BLOCK
    return min(QUANT_RTOL, rtol * math.sqrt(max(1.0, block / QUANT_BLOCK)))


def tolerance(dtype: str, rtol: float | None = None, quantized: dict | None = None, real: bool = False) -> float:
    """``rtol`` if given, else for a graph ``quantized`` (its manifest's scheme; held against fp32)
    its bits' bound (:func:`quant_rtol`), else the tolerance of a graph computed in ``dtype``: on
    random inputs :data:`RTOL`, on real inputs (``real``) :data:`REAL_RTOL`."""
    if rtol is not None:
        return rtol
    if quantized:
        return quant_rtol(quantized)
    table = REAL_RTOL if real else RTOL
    if dtype not in table:
        raise ValueError(f"no parity tolerance for dtype {dtype!r} (known: {', '.join(table)}); pass rtol")
    return table[dtype]


def check_export(directory: str | Path, gamma: int = 5, rtol: float | None = None, max_new_tokens: int = 48,
                 threads: int | None = None, log: Callable[[str], None] = lambda s: None,
                 models: dict[str, Any] | None = None, heads: dict[str, Any] | None = None,
                 only: list[str] | None = None) -> ParityReport:
    """Check every graph of an export directory against its PyTorch source, each held to
    ``rtol`` or, by default, its dtype's tolerance. ``models`` (source name -> transformers
    model) and ``heads`` (graph name -> head module) skip loading from disk; ``only`` restricts
    the check to these graph names."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session
    from spec_plugins.backends.torch_runtime import TorchRuntime, load_hf

    directory = Path(directory)
    man = Manifest.read(directory)
    head_dtype = target_dtype(man)  # before ``only`` drops the verify graph the heads were built on
    if only:
        for name in only:
            man.graph(name)  # an unknown name fails here, naming the graphs there are
        man.graphs = [g for g in man.graphs if g.name in only or (g.name == "verify" and "draft" in only)]
    report = ParityReport(str(directory), notes=list(man.pending))
    given: dict[str, Any] = dict(models or {})
    loaded: dict[tuple[str, str], Any] = {}

    def model_of(source: str, dtype: str) -> Any:
        """The caller's model for ``source``, else ``source`` loaded in ``dtype``: one model per
        (source, dtype), as a graph exported in float16 is compared with the float16 model."""
        if source in given:
            return given[source]
        if (source, dtype) not in loaded:
            loaded[source, dtype] = load_hf(source, dtype, "cpu")[0]
        return loaded[source, dtype]

    tok = None
    if man.tokenizer:
        from spec_plugins.models import load_tokenizer

        tok = load_tokenizer(str(directory / man.tokenizer))
    ids = list(tok(_PROMPT)["input_ids"]) if tok is not None else list(range(1, 25))
    decoders = [g for g in man.graphs if g.kind == "decoder_with_past" and not (only and g.name not in only)]
    for g in decoders:  # before any model loads
        check_gamma(g.name, gamma, len(ids), min(g.max_context, g.context_cap or g.max_context), g.vocab_size)
    for g in decoders:
        log(f"checking {g.name} ({g.source_model}) ...")
        tol = report.tolerances[g.name] = tolerance(g.dtype, rtol, g.quantization)
        real_tol = report.real_tolerances[g.name] = tolerance(g.dtype, rtol, g.quantization, real=True)
        model = model_of(g.source_model, g.dtype)
        session = create_session(directory / g.file, "cpu", threads=threads)
        ort_rt = OnnxRuntime(session, g, tok, eos_token_ids=man.eos_token_ids)  # checks the manifest's fields
        cases = check_random(g.name, session, model, gamma, tol, feature_layers=g.feature_layers)
        context = min([ort_rt.max_context] + ([man.graph("verify").max_context] if g.name == "draft" else []))
        new_tokens = greedy_room(g.name, len(ids), max_new_tokens, context)
        if new_tokens < max_new_tokens:
            report.notes.append(f"{g.name}: greedy output compared over {new_tokens} new tokens, not --max-new-tokens "
                                f"{max_new_tokens}: its {len(ids)}-token prompt fills the rest of the {context}-position context")
        scale_bound = QUANT_SCALE_BOUND if g.quantization else None
        real = check_runtimes(g.name, TorchRuntime(model), ort_rt, ids, gamma, real_tol, scale_bound=scale_bound)
        if g.quantization:
            _mark_quantized(report, g, real, real_tol, reported=cases)
        report.cases += cases + real
        if g.quantization:
            want = greedy_tokens(ort_rt, ids, new_tokens, plain=True)
            got = greedy_tokens(ort_rt, ids, new_tokens)
        elif g.name == "draft":  # the draft graph drafts for the torch target; tokens must not change
            verify = man.graph("verify")
            target = model_of(verify.source_model, verify.dtype)
            want = greedy_tokens(TorchRuntime(target), ids, new_tokens, TorchRuntime(model))
            got = greedy_tokens(TorchRuntime(target), ids, new_tokens, ort_rt)
        else:
            want = greedy_tokens(TorchRuntime(model), ids, new_tokens)
            got = greedy_tokens(ort_rt, ids, new_tokens)
        report.greedy.append(GreedyCase(g.name, len(want), want == got, first_diff(want, got)))
    for g in man.graphs:
        if g.kind != "decoder_with_past":
            from spec_plugins.exporters.onnx_heads import check_head

            log(f"checking {g.name} ...")
            module = (heads or {}).get(g.name)
            # the head graph was traced over the target's weights in the export's dtype
            model = model_of(g.source_model, head_dtype) if module is None else None
            # a quantized head comes from an export made before head graphs stayed float
            tol = report.tolerances[g.name] = tolerance(g.dtype, rtol, g.quantization)
            report.cases += check_head(directory, g, model, tol, module)
    return report


def target_dtype(man: Manifest) -> str:
    """The dtype of the target model the head graphs were built on: the verify graph's (its float
    dtype also when quantized; a head graph's own entry says float32, as it is computed in it)."""
    return next((g.dtype for g in man.graphs if g.name == "verify"), "float32")


def _mark_quantized(report: ParityReport, g: Any, held: list[ParityCase], tol: float,
                    reported: Sequence[ParityCase] = ()) -> None:
    """Label a quantized graph's cases as compared with fp32, the ``reported`` ones (random inputs:
    see :data:`QUANT_RTOL_BITS`) as measured rather than held, and say what the others were held to."""
    for c in held:
        c.case = f"{c.case} vs fp32"
    for c in reported:
        c.case, c.ok, c.reported = f"{c.case} vs fp32", True, True
    report.quantized.append(g.name)
    report.notes.append(f"{g.name} is quantized ({g.quantization.get('name')}): its outputs on real inputs are held "
                        f"to rtol {tol:g} against its fp32 source and its logit scale to within "
                        f"{QUANT_SCALE_BOUND:g}x of 1 (on random inputs reported); its speculative greedy output "
                        "must equal its own plain")

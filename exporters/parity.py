"""Parity of exported graphs with their PyTorch modules (``spec-plugins export check DIR``).

Three checks per decoder graph (target verify graph, draft model graph):
1. random inputs straight into the session: N = 1..gamma+1 new nodes, chain and tree masks,
   non-empty past, B = 2;
2. real inputs through the two runtimes (TorchRuntime vs OnnxRuntime): a real prompt, a
   left-padded batch, chains and a tree with commit/rollback between them;
3. greedy speculative decoding (n-gram drafts) on both runtimes: the tokens must be identical.
Every logits comparison goes through :func:`compare`: max |ort - torch| relative to max |torch|,
held to a tolerance set by the graph's dtype (:data:`RTOL`) unless one is given.

A quantized graph (``export onnx --quantize``) is not the fp32 model, so its logits on real inputs
(step 2) are held to ``rtol`` if one is given, else to the loose bound :data:`QUANT_RTOL` against
its fp32 source (another model's weights miss it); on random inputs (step 1) the error is reported,
not held; step 3 holds it to its own standard: greedy speculative decoding on the quantized graph
must equal plain greedy decoding on it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from spec_plugins.exporters.parity_rule import ParityCase, compare
from spec_plugins.graphs.manifest import Manifest

# max |diff| <= rtol * max |reference|, by graph dtype. float16 keeps 11 bits, and on the random-past
# cases its rounding alone moves the logits by a sizeable share of their scale, while a wrong graph is
# off by about their whole scale: the float16 bound sits between (the measurements that place it are
# in docs/runtimes/onnxruntime.md).
RTOL = {"float32": 1e-4, "float16": 0.2}
# A quantized graph against its fp32 source on real inputs: max |diff| <= QUANT_RTOL * max |fp32 logits|,
# loose enough for every scheme's rounding and far below another model's weights (the measurements that
# place it are in docs/runtimes/onnxruntime.md). Random ids over a random past drive activation
# quantization out of its range, so those cases are reported, not held.
QUANT_RTOL = 0.75
_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again, and"


@dataclass
class GreedyCase:
    graph: str
    tokens: int
    identical: bool
    first_difference: int | None = None


@dataclass
class ParityReport:
    directory: str
    tolerances: dict[str, float] = field(default_factory=dict)  # graph name -> rtol it was held to
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
        quant = [c for c in self.cases if c.graph in self.quantized]
        if quant:  # the logit error of quantized graphs against fp32
            d["quantized_max_rel"] = max(c.rel for c in quant)
        return _finite_or_null(d)

    def format(self) -> str:
        rtols = ", ".join(f"{g} {t:g}" for g, t in self.tolerances.items())
        lines = [f"parity of {self.directory} (tolerance: max|diff| <= rtol x max|logits|; rtol {rtols})"]
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


def random_tree(n: int, gen: torch.Generator) -> tuple[int, ...]:
    """Parents of a random tree of n nodes rooted at node 0 (topological order)."""
    return (-1,) + tuple(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n))


@torch.no_grad()
def check_random(graph: str, session: Any, model: Any, gamma: int, rtol: float, seed: int = 0,
                 past: int = 7) -> list[ParityCase]:
    """Random ids, random past, chain and tree masks, N = 1..gamma+1, fed to the session directly."""
    from spec_plugins.exporters.onnx_verify import VerifyGraph, dummy_inputs
    from spec_plugins.graphs.io import DecoderShape, input_names
    from spec_plugins.tree import layout

    wrapper = VerifyGraph(model).eval()
    shape = DecoderShape.of(model)
    names = input_names(shape.num_layers)
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    out = []
    for n in range(1, gamma + 2):
        for tree in (False, True):
            if tree and n < 3:
                continue  # one and two nodes can only form a chain
            anc = layout(random_tree(n, gen)).ancestors if tree else None
            args = dummy_inputs(shape, 2, n, past, dtype, anc, gen)
            want = wrapper(*args)[0]
            got = session.run(["logits"], {k: v.numpy() for k, v in zip(names, args)})[0]
            out.append(compare(graph, f"random B=2 N={n} P={past} {'tree' if tree else 'chain'}", got, want, rtol))
    return out


@torch.no_grad()
def check_runtimes(graph: str, torch_rt: Any, ort_rt: Any, ids: list[int], gamma: int, rtol: float,
                   seed: int = 0) -> list[ParityCase]:
    """Real prompt ids through both runtimes: prefill (solo and left-padded batch), chains of
    N = 1..gamma+1 with partial commits, a tree with a path commit, a rollback."""
    from spec_plugins.tree import layout

    gen = torch.Generator().manual_seed(seed)
    out = []
    half = ids[: max(1, len(ids) // 2)]
    a, b = torch_rt.prefill([ids, half]).logits, ort_rt.prefill([ids, half]).logits
    out.append(compare(graph, f"real prefill B=2 (left-padded, {len(ids)}/{len(half)} tokens)", b, a, rtol))
    vocab = torch_rt.vocab_size
    for n in range(1, gamma + 2):
        toks = torch.randint(0, vocab, (2, n), generator=gen)
        toks[0] = torch.tensor((ids * 4)[n : 2 * n])  # real continuation-like ids for row 0
        a, b = torch_rt.forward(toks).logits, ort_rt.forward(toks).logits
        out.append(compare(graph, f"real chain B=2 N={n} P={torch_rt.lengths()[0] - n}", b, a, rtol))
        keep = [list(range(int(torch.randint(1, n + 1, (1,), generator=gen)))) for _ in range(2)]
        torch_rt.commit(keep)
        ort_rt.commit(keep)
    n = gamma + 1
    parents = random_tree(max(n, 3), gen)
    lay = layout(parents)
    toks = torch.randint(0, vocab, (2, lay.size), generator=gen)
    a, b = torch_rt.forward(toks, tree=lay).logits, ort_rt.forward(toks, tree=lay).logits
    out.append(compare(graph, f"real tree B=2 N={lay.size} (holes in past)", b, a, rtol))
    leaf = lay.size - 1
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    keep = [sorted(path), [0]]
    torch_rt.commit(keep)
    ort_rt.commit(keep)
    back = [max(1, L - 3) for L in torch_rt.lengths()]
    torch_rt.rollback(back)
    ort_rt.rollback(back)
    toks = torch.randint(0, vocab, (2, 2), generator=gen)
    a, b = torch_rt.forward(toks).logits, ort_rt.forward(toks).logits
    out.append(compare(graph, "real chain after tree commit + rollback", b, a, rtol))
    return out


def greedy_tokens(runtime: Any, prompt: list[int], max_new: int, draft_runtime: Any = None,
                  plain: bool = False) -> list[int]:
    """Greedy speculative decoding: n-gram drafts, or a draft model on ``draft_runtime``;
    ``plain``: no drafts at all."""
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.policy import FixedLength
    from spec_plugins.proposers.draft_model import DraftModelProposer
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.verifiers import ExactVerifier

    if plain:
        prop: Any = None
    elif draft_runtime is not None:
        prop = DraftModelProposer(None, target=runtime, runtime=draft_runtime)
    else:
        prop = NgramProposer(NgramProposer.Config(num_draft_tokens=5))
    toks: list[int] = []
    for step in decode(runtime, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), [prompt], max_new,
                       (), None, None, FixedLength(5)):
        toks.extend(step.emitted.get(0, []))
    return toks


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tolerance(dtype: str, rtol: float | None = None, quantized: bool = False) -> float:
    """``rtol`` if given, else :data:`QUANT_RTOL` for a quantized graph (held against fp32), else
    the tolerance of a graph computed in ``dtype`` (:data:`RTOL`)."""
    if rtol is not None:
        return rtol
    if quantized:
        return QUANT_RTOL
    if dtype not in RTOL:
        raise ValueError(f"no parity tolerance for dtype {dtype!r} (known: {', '.join(RTOL)}); pass rtol")
    return RTOL[dtype]


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
    head_dtype = _target_dtype(man)  # before ``only`` drops the verify graph the heads were built on
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
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(directory / man.tokenizer))
    for g in man.graphs:
        if g.kind != "decoder_with_past" or (only and g.name not in only):
            continue
        log(f"checking {g.name} ({g.source_model}) ...")
        tol = report.tolerances[g.name] = tolerance(g.dtype, rtol, bool(g.quantization))
        model = model_of(g.source_model, g.dtype)
        session = create_session(directory / g.file, "cpu", threads=threads)
        ort_rt = OnnxRuntime(session, g, tok, eos_token_ids=man.eos_token_ids)  # checks the manifest's fields
        cases = check_random(g.name, session, model, gamma, tol)
        ids = list(tok(_PROMPT)["input_ids"]) if tok is not None else list(range(1, 25))
        real = check_runtimes(g.name, TorchRuntime(model), ort_rt, ids, gamma, tol)
        if g.quantization:
            _mark_quantized(report, g, real, tol, reported=cases)
        report.cases += cases + real
        if g.quantization:
            want = greedy_tokens(ort_rt, ids, max_new_tokens, plain=True)
            got = greedy_tokens(ort_rt, ids, max_new_tokens)
        elif g.name == "draft":  # the draft graph drafts for the torch target; tokens must not change
            verify = man.graph("verify")
            target = model_of(verify.source_model, verify.dtype)
            want = greedy_tokens(TorchRuntime(target), ids, max_new_tokens, TorchRuntime(model))
            got = greedy_tokens(TorchRuntime(target), ids, max_new_tokens, ort_rt)
        else:
            want = greedy_tokens(TorchRuntime(model), ids, max_new_tokens)
            got = greedy_tokens(ort_rt, ids, max_new_tokens)
        report.greedy.append(GreedyCase(g.name, len(want), want == got, _first_diff(want, got)))
    for g in man.graphs:
        if g.kind != "decoder_with_past":
            from spec_plugins.exporters.onnx_heads import check_head

            log(f"checking {g.name} ...")
            module = (heads or {}).get(g.name)
            # the head graph was traced over the target's weights in the export's dtype
            model = model_of(g.source_model, head_dtype) if module is None else None
            # a quantized head comes from an export made before head graphs stayed float
            tol = report.tolerances[g.name] = tolerance(g.dtype, rtol, bool(g.quantization))
            report.cases += check_head(directory, g, model, tol, module)
    return report


def _target_dtype(man: Manifest) -> str:
    """The dtype of the target model the head graphs were built on: the verify graph's (its float
    dtype also when quantized; a head graph's own entry says float32, as it is computed in it)."""
    return next((g.dtype for g in man.graphs if g.name == "verify"), "float32")


def _mark_quantized(report: ParityReport, g: Any, held: list[ParityCase], tol: float,
                    reported: Sequence[ParityCase] = ()) -> None:
    """Label a quantized graph's cases as compared with fp32, the ``reported`` ones (random inputs:
    see :data:`QUANT_RTOL`) as measured rather than held, and say what the others were held to."""
    for c in held:
        c.case = f"{c.case} vs fp32"
    for c in reported:
        c.case, c.ok, c.reported = f"{c.case} vs fp32", True, True
    report.quantized.append(g.name)
    report.notes.append(f"{g.name} is quantized ({g.quantization.get('name')}): its logits on real inputs are held "
                        f"to rtol {tol:g} against its fp32 source (on random inputs reported); its speculative "
                        "greedy output must equal its own plain")

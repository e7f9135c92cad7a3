"""The parallel drafter (``heads/parallel.py``, ``proposers/parallel.py``): drafting runs the
block exactly as training does, greedy output equals plain greedy decoding (chain and tree, one
row and a batch; transformers' ``generate()`` in ``test_reference_generate``), sampling is exact
(chi-square, with a power check), the block step compiles as one graph, bad heads are refused
by name, and training lowers the loss and learns a rule."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, plain_greedy
from test_heads import run

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.heads import save_head, target_lm_parts
from spec_plugins.heads.parallel import ParallelConfig, ParallelDrafter
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers import parallel as parallel_module
from spec_plugins.proposers.parallel import ParallelProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.types import ProposeContext
from spec_plugins.verifiers import ExactVerifier

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))
VOCAB_IDS = torch.arange(2, 30)
LAYERS = (1, 2)


DEEP = [(0, False), (2, False), (2, True)]  # one layer; block layers; block layers that see the context


def drafter(model, seed=0, block=4, vocab=VOCAB_IDS, layers=LAYERS, block_layers=0, context=False):
    """A random parallel drafter; its block layers' output projections random too (a trained
    drafter's are not the zeros it starts from), so they change what it drafts."""
    torch.manual_seed(seed)
    lm, emb = target_lm_parts(model)
    cfg = ParallelConfig(lm.shape[1], num_heads=4, num_kv_heads=2, intermediate_size=64,
                         draft_vocab_size=len(vocab), feature_layers=layers, block_size=block,
                         block_layers=block_layers, block_context=context)
    d = ParallelDrafter(cfg, lm, emb, vocab)
    for layer in d.refiner.layers if d.refiner is not None else ():
        torch.nn.init.normal_(layer.o.weight, std=0.5)
        torch.nn.init.normal_(layer.down.weight, std=0.5)
    return d


def proposer(model, mode="tree", nodes=8, top_k=2, **kw):
    cfg = ParallelProposer.Config(heads="unused", mode=mode, tree_nodes=nodes, top_k=top_k)
    return ParallelProposer(cfg, drafter=drafter(model, **kw))


PROMPTS = [[3, 7, 1, 9, 4], [5, 5, 2], [8, 1, 6, 2, 7, 3, 3, 10]]


@pytest.mark.parametrize("block_layers,context", DEEP)
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_output_is_plain_greedy_one_row_and_a_batch(mode, block_layers, context):
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    for k in (1, 3, 6):  # 6: deeper than the block (4): drafting stops at the block
        prop = proposer(model, mode, block_layers=block_layers, context=context)
        outs, stats = run(target, prop, [PROMPTS[0]], 17, k)
        assert outs[0] == plain_greedy(model, PROMPTS[0], 17), (mode, k)
        assert max(len(stats.drafted_by_position), 0) <= 4
        prop = proposer(model, mode, block_layers=block_layers, context=context)
        limits = [5, 17, 11]
        outs, stats = run(target, prop, PROMPTS, limits, k)
        assert outs == [plain_greedy(model, p, n) for p, n in zip(PROMPTS, limits)], (mode, k)
        assert stats.draft_tokens > 0


@pytest.mark.parametrize("block_layers,context", DEEP)
def test_drafting_runs_the_block_exactly_as_training_does(tmp_path, block_layers, context):
    """The marginals the proposer drafts from equal the training pass's (``parallel_train``) for the
    same prefix: the same positions, inputs and attention (and block layers over the same rows),
    so what is trained is what drafts."""
    from spec_plugins.training.batches import Window, eagle_batch
    from spec_plugins.training.features import FeatureStore, extract
    from spec_plugins.training.parallel_train import block_pass, real_pass

    model = tiny_llama(seed=4, sharpness=2.0)
    d = drafter(model, seed=1, block=5, block_layers=block_layers, context=context).eval()
    ids = [4, 9, 2, 7, 7, 1, 3, 12, 5, 8, 0, 0, 0, 0]
    a = 8  # the anchor: the drafter's cache holds pairs j <= a, the pending token is ids[a + 1]

    def batch(ids):
        out = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        extract(model, [(ids, [True] * len(ids))], out, {"target": "t", "layers": list(LAYERS)}, LAYERS, 10_000,
                progress=False)
        return eagle_batch(FeatureStore(out).load(0), [Window(0, 0, len(ids) - 2, 0)], True)

    with torch.no_grad():
        out0 = real_pass(d, batch(ids))[0]
        ids[a + 2] = int(d.vocab_ids[d.logits(out0[0, a]).argmax()])  # training feeds the data; make it the draft
        b = batch(ids)
        out0, keys, values, inputs = real_pass(d, b)
        want = d.logits(block_pass(d, b, keys, values, inputs, out0, torch.tensor([[a]])))[0, 0].log_softmax(-1)

    seen = []
    real = parallel_module.marginal_candidates
    parallel_module.marginal_candidates = lambda logq, *rest: (seen.append(logq), real(logq, *rest))[1]
    try:
        from spec_plugins.training.features import target_outputs

        prop = ParallelProposer(ParallelProposer.Config(heads="unused", mode="chain"), drafter=d)
        prop.admit([ids[: a + 2]])
        feats = target_outputs(model, torch.tensor([ids[: a + 1]]), LAYERS)["layers"].flatten(1)
        prop.propose(ProposeContext([ids[: a + 2]], [5], GREEDY, hidden=[feats]))
    finally:
        parallel_module.marginal_candidates = real
    got = seen[0][0]  # [depth, Vd]
    torch.testing.assert_close(got[0], d.logits(out0[0, a]).float().log_softmax(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1:], want.float(), atol=1e-4, rtol=1e-4)


V = 16
PROMPT = [1, 5, 2, 5]


def _samples(model, prop, pipe, verifier, n=10000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in range(n)]
    for step in decode(TorchRuntime(model), prop, verifier, pipe, [PROMPT] * n, 4, (), gen, None, FixedLength(2)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        if min(len(o) for o in outs) >= 3:
            break
    return [tuple(o[:3]) for o in outs]


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_sampling_is_exact_and_the_test_has_power(mode):
    """Chi-square of the first 3 tokens against the enumerated target law (temperature 0.8,
    top-k 6); the same test with a verifier that forgets rejected siblings must fail (trees)."""
    from test_tree_sampling import NoResidualTree

    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = LogitsPipeline(SamplingConfig(temperature=0.8, top_k=6))
    exact = exact_joint(model, PROMPT, 3, pipe)

    def prop():
        return proposer(model, mode, nodes=6, top_k=3, vocab=torch.arange(V), block=3, seed=2)

    p = chi_square_pvalue(_samples(model, prop(), pipe, ExactVerifier()), exact)
    assert p > 1e-3, p
    if mode == "tree":
        assert chi_square_pvalue(_samples(model, prop(), pipe, NoResidualTree()), exact) < 1e-3


@pytest.mark.parametrize("block_layers,context", DEEP)
def test_the_block_step_compiles_as_one_graph_and_drafts_as_eager(tmp_path, block_layers, context):
    """The block forward over the padded cache (and the block layers), ``torch.compile(fullgraph=True)``
    on the CPU (a graph break would raise): the same drafts as eager, greedy output equal to plain
    decoding."""
    model = tiny_llama(seed=3, sharpness=2.0)
    d = drafter(model, block_layers=block_layers, context=context)
    save_head(d, d.config.to_dict(), tmp_path / "par")
    drafts = {}
    for mode in ("eager", "compile"):
        rt = TorchRuntime(model, matmul="native")
        prop = ParallelProposer(ParallelProposer.Config(heads=str(tmp_path / "par"), tree_nodes=6, top_k=2), target=rt,
                                step_mode=mode)
        seen = drafts[mode] = []
        propose = prop.propose
        prop.propose = lambda ctx, p=propose, seen=seen: (r := p(ctx), seen.append(
            [s.draft.tokens.tolist() for s in r.shaped] if r is not None else None))[0]
        assert run(rt, prop, PROMPTS, 10, 4)[0] == [plain_greedy(model, p, 10) for p in PROMPTS]
        assert prop._block_step.used == (mode == "compile")
    assert drafts["compile"] == drafts["eager"] and drafts["eager"]


def test_an_eagle_head_is_refused_as_a_parallel_one_and_back(tmp_path):
    from test_heads import eagle

    from spec_plugins.heads import EagleDrafter

    model = tiny_llama(seed=3)
    e, p = eagle(model), drafter(model)
    save_head(e, e.config.to_dict(), tmp_path / "eagle")
    save_head(p, p.config.to_dict(), tmp_path / "par")
    with pytest.raises(ValueError, match="does not hold a parallel head.*kind 'eagle'"):
        ParallelDrafter.from_pretrained(str(tmp_path / "eagle"), model)
    with pytest.raises(ValueError, match="does not hold an eagle head.*kind 'parallel'"):
        EagleDrafter.from_pretrained(str(tmp_path / "par"), model)
    loaded = ParallelDrafter.from_pretrained(str(tmp_path / "par"), model)
    assert loaded.config == p.config
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        ParallelConfig(32, block_size=1)


def _edited(tmp_path, model, **fields):
    """A saved drafter whose config.json then says ``fields`` (its weights as they were)."""
    import json

    d = drafter(model)
    save_head(d, d.config.to_dict(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **fields}))
    return str(tmp_path)


@pytest.mark.parametrize("fields,named", [
    ({"block_size": 8}, r"size mismatch for block_inputs: .*torch\.Size\(\[3, 32\]\).*torch\.Size\(\[7, 32\]\)"),
    ({"block_layers": 1}, r'Missing key\(s\) in state_dict: "refiner\.layers\.0\.in_norm\.weight"'),
    ({"mask_token": 32}, r"mask_token 32 is outside this target's vocabulary of 32 tokens"),
    ({"mask_token": -1}, r"mask_token must be a token id \(>= 0\), got -1"),
])
def test_a_head_its_config_does_not_fit_is_refused_with_the_reason(tmp_path, fields, named):
    """A config.json that disagrees with the weights is refused naming the tensor and both shapes
    (or the missing keys), not only torch's heading line; a mask token the target cannot embed is
    refused when loading, not by an IndexError on the first draft."""
    model = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="does not hold a parallel head for this model.*" + named):
        ParallelProposer(ParallelProposer.Config(heads=_edited(tmp_path, model, **fields)), target=TorchRuntime(model))


def test_the_marginal_tree_scores_paths_by_the_product_of_marginals():
    """Every candidate's score is the sum of its path's per-depth log-marginals, its token is its
    depth's, and the best-first prefix is a tree (a child never outscores its parent)."""
    from spec_plugins.proposers.eagle_tree import marginal_candidates

    g = torch.Generator().manual_seed(0)
    logq = torch.randn(2, 3, 10, generator=g).log_softmax(-1)
    vocab = torch.arange(100, 110)
    c = marginal_candidates(logq, vocab, 3)
    assert c.depth == (0,) * 3 + (1,) * 9 + (2,) * 9
    for b in range(2):
        for j, d in enumerate(c.depth):
            path, node = [], j
            while node >= 0:
                path.append(node)
                node = int(c.parent[b, node])
            assert len(path) == d + 1
            want = sum(float(logq[b, c.depth[n], int(c.tokens[b, n]) - 100]) for n in path)
            assert abs(float(c.logp[b, j]) - want) < 1e-5
            par = int(c.parent[b, j])
            assert par < 0 or c.logp[b, j] <= c.logp[b, par]
    # depth 2 grows from the 3 best depth-1 candidates by score
    best1 = set(c.logp[0, 3:12].topk(3).indices.add(3).tolist())
    assert set(c.parent[0, 12:].tolist()) == best1


@pytest.mark.parametrize("block_layers,context", DEEP)
def test_the_parallel_drafter_exports_to_onnx_and_checks_against_its_saved_head(tmp_path, block_layers, context):
    """Its layer exports as the EAGLE layer's graph, its block layers as a graph of their own; the
    parity check loads the saved head by its kind (a parallel head is not an EAGLE head) and
    compares ONNX Runtime with PyTorch on each graph."""
    pytest.importorskip("onnxruntime")
    from spec_plugins.exporters.onnx_export import export_models
    from spec_plugins.exporters.parity import check_export

    model = tiny_llama(vocab=32, seed=2)
    d = drafter(model, layers=(), block_layers=block_layers, context=context)
    save_head(d, d.config.to_dict(), tmp_path / "par")  # fp16 on disk: export what loads, as export_config does
    d = ParallelDrafter.from_pretrained(str(tmp_path / "par"), model)
    man = export_models(tmp_path / "export", (model, None, "tiny"), heads=[("parallel", d, str(tmp_path / "par"))])
    want = [("parallel", "eagle_layer")] + [("parallel-block", "block_refiner")] * (block_layers > 0)
    assert [(g.name, g.kind) for g in man.graphs[1:]] == want
    rep = check_export(tmp_path / "export", gamma=1, max_new_tokens=4, models={"tiny": model})
    assert rep.ok, rep.format()
    assert sum(c.graph == "parallel" for c in rep.cases) == 9  # 3 shapes: features, new keys, new values
    assert sum(c.graph == "parallel-block" for c in rep.cases) == 3 * (block_layers > 0)


def test_block_layers_start_as_the_one_layer_drafter_and_load_by_name(tmp_path):
    """Fresh block layers are the identity (zero output projections), so a deeper drafter trained
    from a one-layer head starts where it was; a saved deeper drafter loads with its block layers,
    and a one-layer head's config (no block_layers) still loads."""
    model = tiny_llama(seed=3)
    lm, emb = target_lm_parts(model)
    cfg = ParallelConfig(lm.shape[1], num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=28,
                         feature_layers=LAYERS, block_size=4, block_layers=2)
    fresh = ParallelDrafter(cfg, lm, emb, VOCAB_IDS)
    g = torch.Generator().manual_seed(0)
    depth0, block = torch.randn(2, 5, lm.shape[1], generator=g), torch.randn(2, 5, 3, lm.shape[1], generator=g)
    torch.testing.assert_close(fresh.refine(depth0, block), block)
    deep = drafter(model, block_layers=2)
    assert not torch.allclose(deep.refine(depth0, block), block)
    save_head(deep, deep.config.to_dict(), tmp_path / "deep")
    loaded = ParallelDrafter.from_pretrained(str(tmp_path / "deep"), model)
    assert loaded.config.block_layers == 2
    torch.testing.assert_close(loaded.refine(depth0, block), deep.refine(depth0, block), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="block_layers must be 0..16"):
        ParallelConfig(32, block_layers=-1)
    with pytest.raises(ValueError, match="block_context needs block layers"):
        ParallelConfig(32, block_context=True)


def test_block_layers_with_context_start_as_the_one_layer_drafter_and_read_the_cache():
    """Fresh context layers are the identity too; trained ones read the cached pairs: which pairs
    an anchor sees changes its block, and a refine without the cache is refused by name."""
    model = tiny_llama(seed=3)
    lm, emb = target_lm_parts(model)
    cfg = ParallelConfig(lm.shape[1], num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=28,
                         feature_layers=LAYERS, block_size=4, block_layers=2, block_context=True)
    assert cfg.cache_heads == 6
    g = torch.Generator().manual_seed(0)
    depth0, block = torch.randn(2, lm.shape[1], generator=g), torch.randn(2, 3, lm.shape[1], generator=g)
    keys, values = torch.randn(2, 6, 5, cfg.head_dim, generator=g), torch.randn(2, 6, 5, cfg.head_dim, generator=g)
    base, every = torch.tensor([4, 7]), torch.ones(2, 5, dtype=torch.bool)
    fresh = ParallelDrafter(cfg, lm, emb, VOCAB_IDS)
    torch.testing.assert_close(fresh.refine(depth0, block, None, base, keys, values, every), block)
    d = drafter(model, block_layers=2, context=True)
    some = every.clone()
    some[:, 2:] = False
    full, part = d.refine(depth0, block, None, base, keys, values, every), d.refine(depth0, block, None, base, keys,
                                                                                  values, some)
    assert not torch.allclose(full, part) and not torch.allclose(full, block)
    with pytest.raises(ValueError, match="block_context refines with the cache"):
        d.refine(depth0, block)

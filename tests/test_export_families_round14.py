"""Export families round 14: JetMoE's verify graph froze the trace's expert routing (its Split sizes
are constants) yet exported with exit 0, giving other logits, or an ONNX Runtime crash, at other
token counts; families the TorchScript exporter cannot trace (Cohere's interleaved rope, Mixtral's
``aten::histc``, DeepSeek's MLA, Apertus's ``aten::expm1``) failed with raw tracebacks and a dump of
the whole traced graph instead of a refusal naming the family."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.exporters.onnx_verify import UnsupportedModel, VerifyGraph  # noqa: E402

V = 64
_BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
CONFIGS = {
    "jetmoe": ("JetMoeConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2,
                                    kv_channels=8, intermediate_size=64, max_position_embeddings=256, **_MOE,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    "cohere": ("CohereConfig", dict(_BASE, logit_scale=0.5)),
    "mixtral": ("MixtralConfig", dict(_BASE, **_MOE)),
    "deepseek_v3": ("DeepseekV3Config", dict(_BASE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
                                             n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
                                             moe_intermediate_size=16, n_group=1, topk_group=1)),
    "apertus": ("ApertusConfig", _BASE),
}


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    """A one-layer random model of ``family``, its weights doubled so the routing and the logits
    depend on the tokens."""
    import transformers

    name, kw = CONFIGS[family]
    cfg = getattr(transformers, name)(**kw)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    return m


# ---- 1. a graph that froze a data-dependent step ----------------------------------------------------
def test_jetmoe_export_is_refused_not_written(tmp_path):
    """JetMoE's graph runs only at the trace's token count (and computes other logits at some
    others): the export is refused naming the family and the shape, and nothing is left."""
    out = tmp_path / "exp" / "out"
    with pytest.raises(UnsupportedModel, match=r"JetMoeForCausalLM \(model_type jetmoe\).* at B=\d N=\d P=\d"):
        export_models(out, (tiny("jetmoe"), None, "tiny-jetmoe"), feature_layers=())
    assert not (tmp_path / "exp").exists()  # neither the output, its temporary directory nor its parent


def test_check_traced_refuses_a_graph_computing_other_logits(tmp_path):
    """The comparison itself, where ONNX Runtime runs the graph without error: a graph held against
    another model than the one traced is refused, naming the output; against its own it passes."""
    from spec_plugins.exporters.onnx_verify import check_traced

    export_models(tmp_path / "out", (tiny_llama(vocab=32, seed=1), None, "tiny"), feature_layers=())
    graph = tmp_path / "out" / "verify.onnx"
    check_traced(graph, VerifyGraph(tiny_llama(vocab=32, seed=1)).eval(), torch.device("cpu"))
    with pytest.raises(UnsupportedModel, match=r"computes another logits than the model at B=1 N=5 P=3"):
        check_traced(graph, VerifyGraph(tiny_llama(vocab=32, seed=2)).eval(), torch.device("cpu"))


# ---- 2. families the exporter cannot trace ----------------------------------------------------------
@pytest.mark.parametrize("family, cause", [
    ("cohere", "AssertionError: All tensors must have the same rank"),
    ("mixtral", "aten::histc"),
    ("deepseek_v3", "RuntimeError: Sizes of tensors must match"),
    ("apertus", "aten::expm1"),
])
def test_untraceable_family_is_refused_by_name(tmp_path, family, cause):
    """Refused with UnsupportedModel (a ValueError: the CLIs print it and exit 2) naming the family
    and the tracer's error in one line."""
    out = tmp_path / "exp" / "out"
    with pytest.raises(UnsupportedModel) as err:
        export_models(out, (tiny(family), None, f"tiny-{family}"), feature_layers=())
    msg = str(err.value)
    assert f"(model_type {family})" in msg and cause in msg and "\n" not in msg, msg
    assert not (tmp_path / "exp").exists()


def _model_dir(tmp_path, family: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / f"tiny-{family}"
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w63").save_pretrained(str(d))
    tiny(family).save_pretrained(str(d))
    return d


@pytest.mark.parametrize("family", ["cohere", "jetmoe"])
def test_cli_refuses_by_name_on_export_and_first_use(tmp_path, monkeypatch, family):
    """``export onnx`` and a ``backend: onnxruntime`` config exporting on first use both exit 2
    with the refusal (no traceback), and the cache holds no export."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"target": {"backend": "onnxruntime", "model": str(_model_dir(tmp_path, family))},
                               "proposer": {"type": "ngram"}}))
    runner = CliRunner()
    for args in (["export", "onnx", "--config", str(cfg), "--out", str(tmp_path / "out")],
                 ["generate", "--config", str(cfg), "--prompt", "w1 w2 w3", "--max-new-tokens", "4"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (args, res.output, res.exception)
        assert f"model_type {family}" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("manifest.json"))


def test_the_machine_running_out_of_memory_is_not_blamed_on_the_model(tmp_path, monkeypatch):
    """An allocation failing while tracing is the machine's, raised as it is: no "cannot be
    traced ... run it on the torch backend" for a family that exports."""
    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch.onnx, "export", oom)
    with pytest.raises(RuntimeError, match="can't allocate memory") as err:
        export_models(tmp_path / "out", (tiny_llama(vocab=32, seed=1), None, "tiny"), feature_layers=())
    assert not isinstance(err.value, UnsupportedModel)

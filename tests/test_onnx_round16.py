"""ONNX exports at their edges (round 16): a graph whose opset ONNX Runtime does not support and a
manifest whose ``opset`` the exporter never writes are refused as ManifestErrors naming the file;
``export check`` on an export with a short context compares what the context leaves."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402

torch.set_num_threads(1)


def _tokenizer():
    """The word-level tokenizer of ``test_onnx_runtime.tiny_model_dir`` (export check's prompt: 22 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31")


def _export(root, ctx: int):
    """A tiny llama of ``ctx`` positions saved with its tokenizer, and its export: (model dir, export dir)."""
    model, tok = tiny_llama(vocab=32, seed=4, sharpness=4.0, max_pos=ctx), _tokenizer()
    src = root / f"tiny-{ctx}"
    model.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    export_models(root / f"exp-{ctx}", (model, tok, str(src)))
    return src, root / f"exp-{ctx}"


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """An export of a model with a 64-position context (under export check's prompt + 48 tokens)."""
    return _export(tmp_path_factory.mktemp("r16"), 64)


def _copy(export, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(export, out)
    return out


# ---- 1. opsets -----------------------------------------------------------------------------------
def test_a_graph_opset_onnxruntime_does_not_support_is_a_manifest_error(short, tmp_path):
    """A graph importing ai.onnx opset 99 crashed loading with ONNX Runtime's raw Fail, while opset 9
    was a ManifestError: both name the graph file and ONNX Runtime's reason."""
    import onnx

    from spec_plugins.backends.onnxruntime_runtime import create_session

    d = _copy(short[1], tmp_path)
    for version in (99, 9):
        g = onnx.load(str(d / "verify.onnx"))
        for o in g.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = version
        onnx.save(g, str(d / "verify.onnx"))
        with pytest.raises(ManifestError, match=r"cannot load graph .*verify\.onnx: .*\(onnxruntime ") as err:
            create_session(d / "verify.onnx", "cpu", threads=1)
        assert version == 9 or "Opset 99" in str(err.value), err.value  # ONNX Runtime's reason


def test_export_check_names_the_graph_onnxruntime_cannot_load(short, tmp_path):
    """``export check`` on such a graph exits 2 with the error, not a traceback."""
    import onnx

    from spec_plugins.cli import app

    d = _copy(short[1], tmp_path)
    g = onnx.load(str(d / "verify.onnx"))
    for o in g.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 99
    onnx.save(g, str(d / "verify.onnx"))
    man = json.loads((d / "manifest.json").read_text())
    man["graphs"][0]["size_bytes"] = os.path.getsize(d / "verify.onnx")
    (d / "manifest.json").write_text(json.dumps(man))
    res = CliRunner().invoke(app, ["export", "check", str(d), "--threads", "1"])
    assert res.exit_code == 2, res.output
    assert "cannot load graph" in res.output and "verify.onnx" in res.output, res.output


@pytest.mark.parametrize("opset", [99, 13])
def test_a_manifest_opset_the_exporter_never_writes_is_refused(short, tmp_path, opset):
    """The manifest's ``opset`` was never checked: 99 and 13 loaded and ran."""
    d = _copy(short[1], tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    man["opset"] = opset
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match=rf"manifest\.json: opset {opset} is outside .*\(14\.\.20\)"):
        Manifest.read(d)


# ---- 2. export check on a short context ----------------------------------------------------------
def test_export_check_compares_what_a_short_context_leaves(short):
    """Its own 22-token prompt plus the default 48 new tokens ran past 64 positions: the check failed
    on any export of a context under 70. The greedy comparison runs the 42 tokens left, and says so."""
    from spec_plugins.cli import app

    res = CliRunner().invoke(app, ["export", "check", str(short[1]), "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "greedy speculative, 42 tokens: identical" in res.output, res.output
    assert "compared over 42 new tokens, not --max-new-tokens 48" in res.output and "64-position" in res.output


def test_export_check_refuses_a_context_its_prompt_does_not_fit(tmp_path):
    """A context of 16 positions holds not even the check's prompt: a clear error saying so."""
    from spec_plugins.exporters.parity import check_export

    src, exp = _export(tmp_path, 16)
    model = tiny_llama(vocab=32, seed=4, sharpness=4.0, max_pos=16)
    with pytest.raises(ValueError, match=r"holds 16 positions of context; export check's prompt of 22 tokens "
                                         r"leaves none for a new token"):
        check_export(exp, models={str(src): model}, threads=1)

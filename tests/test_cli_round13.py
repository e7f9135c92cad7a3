"""What a new user runs first, at its edges (hardening round 13): a weights file cut short is an
error naming the model, and a ``--json-schema`` file that holds no object is refused by name."""

from __future__ import annotations

import pytest
from test_cli_input import nothing_runs, run  # noqa: F401  (the fixture, used by name)
from test_training_hardening import save_model

from spec_plugins.backends.torch_runtime import load_hf


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_weights_file_cut_short_is_an_error_naming_the_model(tmp_path, kind):
    """An interrupted copy: safetensors' own error and torch's zip reader's RuntimeError passed
    both handlers (a raw traceback, exit 1)."""
    import torch
    from safetensors.torch import load_file

    d = save_model(tmp_path / "m")
    if kind == "bin":  # the same weights in torch's zip format
        torch.save(load_file(tmp_path / "m" / "model.safetensors"), tmp_path / "m" / "pytorch_model.bin")
        (tmp_path / "m" / "model.safetensors").unlink()
    weights = tmp_path / "m" / ("model.safetensors" if kind == "safetensors" else "pytorch_model.bin")
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(ValueError, match=r"cannot load the model weights from .*m: (SafetensorError|RuntimeError)"):
        load_hf(d)


@pytest.mark.parametrize("text, got", [("null", "NoneType"), ('""', "str"), ('"{\\"type\\": \\"integer\\"}"', "str")],
                         ids=["null", "empty-string", "encoded-schema"])
def test_a_json_schema_file_holding_no_object_is_refused_naming_it(nothing_runs, tmp_path, text, got):  # noqa: F811
    """``null`` and ``""`` raised a GrammarError traceback (exit 1); a JSON string holding a schema
    was decoded a second time and silently used."""
    f = tmp_path / "schema.json"
    f.write_text(text)
    code, out = run(["generate", "--prompt", "hi", "--json-schema", str(f)])
    assert code == 2 and "schema.json: a JSON schema must be an object, got " + got in out, out


@pytest.mark.parametrize("value, msg", [("nan", "--temperature nan: give a finite number"),
                                        ("-1", "--temperature -1.0: give 0 (greedy) or more")])
def test_a_temperature_that_is_no_number_or_below_0_is_named(nothing_runs, value, msg):  # noqa: F811
    """typer's range check answered nan with "should be greater than or equal to 0"."""
    code, out = run(["generate", "--prompt", "hi", "-t", value])
    assert code == 2 and msg in out, out

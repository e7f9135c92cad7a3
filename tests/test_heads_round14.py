"""A trained head is refused on another target of the same shapes (it loaded and drafted tokens
that target rejects): its config.json records a sample of its target's LM head and embeddings,
which a bf16 or 4-bit quantized copy of the same weights still matches; heads saved before the
sample was recorded (the shipped ones) load as they did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_training_hardening import feature_dir, save_model

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.medusa import MedusaProposer
from spec_plugins.proposers.parallel import ParallelProposer
from spec_plugins.training.features import FeatureStore
from spec_plugins.training.trainer import TrainConfig

PROPOSERS = {"eagle": EagleProposer, "medusa": MedusaProposer, "parallel": ParallelProposer}
KINDS = tuple(PROPOSERS)
FINGERPRINT = "target_fingerprint"  # the config.json field
SHIPPED = Path(__file__).resolve().parents[1] / "examples" / "heads" / "smollm2-135m-instruct"


def hf(directory: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict[str, str], dict[str, Path]]:
    """Model directories a and b (same shapes, other weights) and a head of each kind trained,
    by the trainers, on a's features."""
    from spec_plugins.training.eagle_train import train_eagle
    from spec_plugins.training.medusa_train import train_medusa

    root = tmp_path_factory.mktemp("r14")
    dirs = {"a": save_model(root / "a", seed=4), "b": save_model(root / "b", seed=5)}
    model = hf(dirs["a"])
    store = FeatureStore(feature_dir(model, root / "feat-a", dirs["a"]))
    cfg = TrainConfig(epochs=1, batch_size=2, window=16, unroll=2)
    heads = {kind: root / kind for kind in KINDS}
    train_eagle(store, model, cfg, heads["eagle"], True, vocab_size=24, progress=False)
    train_eagle(store, model, cfg, heads["parallel"], True, vocab_size=24, progress=False, block_size=3)
    train_medusa(store, model, cfg, heads["medusa"], 2, 24, progress=False)
    return dirs, heads


def load(kind: str, directory: Path, model) -> object:
    cls = PROPOSERS[kind]
    return cls(cls.Config(heads=str(directory), tree_nodes=6, top_k=2), target=TorchRuntime(model))


def quantized(model, bits: int = 4, group: int = 32):
    """``model`` with its LM head and embeddings rounded to ``bits``-bit symmetric blocks of
    ``group`` (as a Q4_0 GGUF or an int4 export stores them)."""
    top = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for w in (model.get_output_embeddings().weight, model.get_input_embeddings().weight):
            blocks = w.view(-1, group)
            scale = blocks.abs().amax(1, keepdim=True) / top
            blocks.copy_((blocks / scale).round().clamp(-top - 1, top) * scale)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_head_refused_on_another_target_of_the_same_shapes(trained, kind):
    dirs, heads = trained
    with pytest.raises(ValueError) as err:
        load(kind, heads[kind], hf(dirs["b"]))
    msg = str(err.value)
    assert str(heads[kind]) in msg and repr(dirs["a"]) in msg and repr(dirs["b"]) in msg, msg
    assert FINGERPRINT in msg, msg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("copy", ["float32", "bfloat16", "float16", "int4"])
def test_head_accepted_on_its_target_in_another_dtype_or_quantized(trained, kind, copy):
    dirs, heads = trained
    model = quantized(hf(dirs["a"])) if copy == "int4" else hf(dirs["a"], getattr(torch, copy))
    load(kind, heads[kind], model)


@pytest.mark.parametrize("kind", KINDS)
def test_trainers_record_the_target_and_its_sample(trained, kind):
    dirs, heads = trained
    cfg = json.loads((heads[kind] / "config.json").read_text())
    assert cfg["target"] == dirs["a"]
    sample = cfg[FINGERPRINT]
    assert len(sample["rows"]) == len(sample["cols"]) == len(sample["lm_head"]) > 0
    assert ("embed" in sample) == (kind != "medusa")  # Medusa heads use the LM head alone
    lm = hf(dirs["a"]).get_output_embeddings().weight
    assert sample["lm_head"] == pytest.approx(lm[sample["rows"], sample["cols"]].tolist(), rel=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_head_saved_without_a_sample_loads_on_shapes_alone(trained, kind, tmp_path):
    """The format before the sample: no way to tell the target, so it loads as it did."""
    dirs, heads = trained
    old = shutil.copytree(heads[kind], tmp_path / kind)
    cfg = json.loads((old / "config.json").read_text())
    for field in (FINGERPRINT, "target"):
        cfg.pop(field, None)
    (old / "config.json").write_text(json.dumps(cfg))
    for name in ("a", "b"):
        load(kind, old, hf(dirs[name]))


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_heads_have_no_sample_and_load(kind):
    from spec_plugins.heads import drafter_class
    from spec_plugins.heads.medusa import MedusaHeads

    cfg = json.loads((SHIPPED / kind / "config.json").read_text())
    assert FINGERPRINT not in cfg
    V, H = 49152, cfg["hidden_size"]  # SmolLM2-135M's vocabulary and width
    cls = MedusaHeads if kind == "medusa" else drafter_class(str(SHIPPED / kind))
    cls.from_pretrained(str(SHIPPED / kind), (torch.zeros(V, H), torch.zeros(V, H)))


@pytest.mark.parametrize("edit", [{"rows": "0"}, {"rows": []}, {"cols": [0]}, {"lm_head": [1.0, "x"]},
                                  {"rows": [0.5, 1]}, {"embed": [float("inf")] * 2}])
def test_hand_edited_sample_refused_naming_the_field(trained, tmp_path, edit):
    dirs, heads = trained
    bad = shutil.copytree(heads["eagle"], tmp_path / "eagle")
    cfg = json.loads((bad / "config.json").read_text())
    sample = {"rows": [1, 2], "cols": [0, 3], "lm_head": [0.1, 0.2], "embed": [0.1, 0.2]}
    (bad / "config.json").write_text(json.dumps({**cfg, FINGERPRINT: {**sample, **edit}}))
    with pytest.raises(ValueError) as err:
        load("eagle", bad, hf(dirs["a"]))
    assert str(bad) in str(err.value) and FINGERPRINT in str(err.value), str(err.value)


def test_sample_outside_the_target_is_another_target(trained, tmp_path):
    dirs, heads = trained
    bad = shutil.copytree(heads["medusa"], tmp_path / "medusa")
    cfg = json.loads((bad / "config.json").read_text())
    cfg[FINGERPRINT]["cols"][0] = 10_000  # a wider target's column
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trained for another target"):
        load("medusa", bad, hf(dirs["a"]))


"""``spec-plugins export onnx --config FILE --out DIR`` and ``spec-plugins export check DIR``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from spec_plugins.cli import app, check_output_dir, fail, load_config
from spec_plugins.graphs.io import MAX_OPSET, MIN_OPSET, OPSET

export_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Export the target/draft graphs (ONNX) and check them against PyTorch.")
app.add_typer(export_app, name="export")


def _log(msg: str) -> None:
    typer.secho(msg, err=True, fg=typer.colors.CYAN)


@export_app.command("onnx")
def export_onnx(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML/JSON SpecConfig (default: built-in)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write: a new or empty one, or a previous "
                                                      "export (replaced); anything else is refused."),
    opset: int = typer.Option(OPSET, "--opset", help=f"ONNX opset ({MIN_OPSET}..{MAX_OPSET})."),
    feature_layers: str = typer.Option("auto", "--feature-layers",
                                       help="Decoder-layer outputs the verify graph also returns for EAGLE-3 "
                                            "drafters: auto (the drafter's, else low/mid/high), none, or e.g. 3,15,28."),
    quantize: str = typer.Option("none", "--quantize", help="Weight-only quantization: none, int4 or int8 "
                                                            "(ONNX Runtime MatMulNBits)."),
    block_size: int = typer.Option(32, "--block-size", help="Quantization block (weights sharing one scale)."),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="Blocks with zero points (default symmetric)."),
    accuracy_level: int = typer.Option(4, "--accuracy-level", min=0, max=4,
                                       help="ORT compute accuracy of quantized MatMuls (4 = int8 activations)."),
    fp32_lm_head: bool = typer.Option(False, "--fp32-lm-head", help="Keep the LM head in fp32."),
    gguf_grid: bool = typer.Option(False, "--gguf-grid", help="Carry the source GGUF's own Q4_1/Q8_0 blocks "
                                                              "instead of re-quantizing (GGUF models only)."),
) -> None:
    """Write the verify graph of the target, the draft graphs and manifest.json to DIR."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.config import ConfigError
    from spec_plugins.exporters.onnx_export import export_config

    check_output_dir(out)
    t0 = time.perf_counter()
    try:
        scheme = None
        if quantize not in ("none", "int4", "int8"):
            raise ValueError(f"--quantize {quantize!r}; allowed values: none, int4, int8")
        if quantize != "none":
            from spec_plugins.graphs.quant import QuantScheme

            scheme = QuantScheme(int(quantize[3:]), block_size, not asymmetric, accuracy_level, not fp32_lm_head,
                                 "gguf" if gguf_grid else "rtn")
        man = export_config(load_config(config), out, opset, log=_log, feature_layers=feature_layers,
                            quantize=scheme)
    except (ConfigError, ValueError, FileNotFoundError, LookupError, ImportError) as exc:
        fail(str(exc))
        return
    for g in man.graphs:
        typer.echo(f"{g.name:<8} {out / g.file}  {g.size_bytes / 2**20:.1f} MiB  exported in {g.export_seconds:.1f} s")
    for p in man.pending:
        typer.echo(f"pending: {p}")
    typer.echo(f"manifest: {out / 'manifest.json'}  (total {time.perf_counter() - t0:.1f} s including model load)")


@export_app.command("check")
def export_check(
    directory: Path = typer.Argument(..., help="An export directory (with manifest.json)."),
    gamma: int = typer.Option(5, "--gamma", min=1, max=64, help="Check N = 1..gamma+1 new nodes."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Allowed max|diff| relative to max|logits| "
                                                               "(default: by each graph's dtype, see "
                                                               "docs/runtimes/onnxruntime.md)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", min=1, help="Greedy speculative tokens compared."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="ONNX Runtime intra-op threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    graph: list[str] = typer.Option([], "--graph", help="Only check this graph (repeatable; default: all)."),
) -> None:
    """ONNX Runtime vs PyTorch on random and real inputs; exit 1 on any mismatch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.exporters.parity import check_export

    try:
        report = check_export(directory, gamma, rtol, max_new_tokens, threads, log=_log, only=graph or None)
    except (ValueError, FileNotFoundError, LookupError, ImportError) as exc:
        fail(str(exc))
        return
    typer.echo(json.dumps(report.to_dict()) if as_json else report.format())
    if not report.ok:
        raise typer.Exit(1)


def _register_other_formats() -> None:
    """Other export formats add their commands to ``export`` (``tensorrt``: exporters/tensorrt_build.py)."""
    import importlib

    for mod in ("spec_plugins.exporters.tensorrt_build",):
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # not built yet
            raise
        module.add_command(export_app)


_register_other_formats()

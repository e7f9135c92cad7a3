"""``spec-plugins export onnx --config FILE --out DIR`` and ``spec-plugins export check DIR``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.cli import app, check_finite, check_output_dir, fail, load_config
from spec_plugins.graphs.io import MAX_OPSET, MIN_OPSET, OPSET

if TYPE_CHECKING:
    from spec_plugins.graphs.quant import QuantScheme

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
                                            "drafters: auto (the config target's feature_layers, else the "
                                            "drafter's, else low/mid/high), none, or e.g. 3,15,28."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Weight-only quantization: none, int4 or int8 "
                                                                     "(ONNX Runtime MatMulNBits; default: each "
                                                                     "graph's config section's quantize (target, "
                                                                     "draft model), else none)."),
    block_size: Optional[int] = typer.Option(None, "--block-size",
                                             help="Quantization block (weights sharing one scale; default 32)."),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="Blocks with zero points (default symmetric)."),
    accuracy_level: Optional[int] = typer.Option(None, "--accuracy-level", min=0, max=4,
                                                 help="ORT compute accuracy of quantized MatMuls (4 = int8 "
                                                      "activations; the default)."),
    fp32_lm_head: bool = typer.Option(False, "--fp32-lm-head", help="Keep the LM head in fp32."),
    gguf_grid: bool = typer.Option(False, "--gguf-grid", help="Carry the source GGUF's own Q4_1/Q8_0 blocks "
                                                              "instead of re-quantizing (GGUF models only; "
                                                              "--quantize int4, default block)."),
) -> None:
    """Write the verify graph of the target, the draft graphs and manifest.json to DIR."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.config import ConfigError
    from spec_plugins.exporters.onnx_export import export_config

    t0 = time.perf_counter()
    try:
        check_feature_layers(feature_layers)
        flagged = quant_scheme(quantize or "none", block_size, asymmetric, accuracy_level, fp32_lm_head, gguf_grid)
    except ValueError as exc:
        fail(exc)
        return
    check_output_dir(out)
    check_can_create(out)
    try:
        cfg = load_config(config)
        schemes = section_schemes(flagged, quantize is not None, cfg)
        check_gguf_sources(schemes, cfg)
        man = export_config(cfg, out, opset, log=_log, feature_layers=feature_layers, quantize=schemes)
    except (ConfigError, ValueError, OSError, LookupError, ImportError) as exc:  # OSError: reading or writing
        fail(exc)
        return
    for g in man.graphs:
        typer.echo(f"{g.name:<8} {out / g.file}  {g.size_bytes / 2**20:.1f} MiB  exported in {g.export_seconds:.1f} s")
    for p in man.pending:
        typer.echo(f"pending: {p}")
    typer.echo(f"manifest: {out / 'manifest.json'}  (total {time.perf_counter() - t0:.1f} s including model load)")


def check_feature_layers(spec: str) -> None:
    """``--feature-layers``' syntax, checked before any model loads: ``auto``, ``none`` or layer
    outputs numbered from 1 (``parse_feature_layers``' forms); the model's layer count, the upper
    bound, is checked once it has loaded (``export_layers``)."""
    from spec_plugins.heads.eagle import parse_feature_layers

    try:
        parse_feature_layers(spec, sys.maxsize)  # the model's layer count, the upper bound, comes later
    except ValueError:
        raise ValueError(f"--feature-layers {spec!r}: expected auto, none or comma-separated layer outputs "
                         "numbered from 1, such as 3,15,28") from None


def quant_scheme(quantize: str, block_size: int | None, asymmetric: bool, accuracy_level: int | None,
                 fp32_lm_head: bool, gguf_grid: bool) -> "QuantScheme | None":
    """The ``QuantScheme`` the quantization flags ask for (None for ``--quantize none``), checked
    before any model loads: a flag that would change nothing is refused by name, not ignored."""
    if quantize not in ("none", "int4", "int8"):
        raise ValueError(f"--quantize {quantize!r}; allowed values: none, int4, int8")
    flags = {"--block-size": block_size is not None, "--asymmetric": asymmetric,
             "--accuracy-level": accuracy_level is not None, "--fp32-lm-head": fp32_lm_head, "--gguf-grid": gguf_grid}
    if quantize == "none":
        given = [f for f, on in flags.items() if on]
        if given:
            raise ValueError(f"{', '.join(given)} set how weights are quantized; add --quantize int4 or int8 "
                             "(without it the export takes each config section's quantize: and quant_* fields)")
        return None
    from spec_plugins.graphs.quant import QuantScheme, gguf_conflicts

    try:
        scheme = QuantScheme(int(quantize[3:]), 32 if block_size is None else block_size, not asymmetric,
                             4 if accuracy_level is None else accuracy_level, not fp32_lm_head,
                             "gguf" if gguf_grid else "rtn")
    except ValueError as exc:  # the block size: the one flag typer does not range-check
        raise ValueError(f"--block-size {block_size}: {exc}") from None
    if gguf_grid and (bad := gguf_conflicts(scheme)):
        named = {"bits": f"--quantize {quantize}", "block_size": f"--block-size {block_size}",
                 "symmetric": "--asymmetric"}
        raise ValueError(f"--gguf-grid carries the GGUF's own blocks (Q4_1 4-bit, Q8_0 8-bit, 32 weights a block); "
                         f"it takes no {', '.join(named[f] for f in bad)}: use --quantize int4 --gguf-grid")
    return scheme


def section_schemes(flagged: QuantScheme | None, given: bool, cfg: Any) -> dict[str, QuantScheme | None]:
    """Each decoder graph's scheme (``export_scheme``): the verify graph's from the config's target,
    the draft graph's from its draft model's section, so that each section with ``path:`` set
    loads the graph made for it."""
    schemes = {"verify": export_scheme(flagged, given, cfg.target, "target")}
    prop = cfg.proposer
    if prop is not None and prop.type == "draft_model":
        schemes["draft"] = export_scheme(flagged, given, prop.model, "proposer.model")
    return schemes


def check_gguf_sources(schemes: dict[str, QuantScheme | None], cfg: Any) -> None:
    """``check_gguf_source`` for each graph to export: the target's, and a draft model's."""
    from spec_plugins.graphs.quant import check_gguf_source

    check_gguf_source(schemes.get("verify"), cfg.target.model, "target")
    if "draft" in schemes:
        check_gguf_source(schemes["draft"], cfg.proposer.model.model, "proposer.model")


def export_scheme(flagged: QuantScheme | None, given: bool, target: Any, section: str = "target"
                  ) -> QuantScheme | None:
    """The scheme to export for one config section (``target``, named ``section``): ``--quantize``'s
    (``flagged``) when ``given``, else the section's (an onnxruntime section's ``quantize:``), so
    that section with ``path:`` set loads the export. A section that sets ``quantize:`` to another
    scheme than the flags is refused, naming both."""
    from spec_plugins.graphs.quant import QuantScheme

    fields = target.scheme() if callable(getattr(target, "scheme", None)) else None
    configured = QuantScheme(**fields) if fields else None
    if not given:
        return configured
    if "quantize" in getattr(target, "model_fields_set", ()) and flagged != configured:
        def name(s: QuantScheme | None) -> str:
            return s.name if s is not None else "none"

        raise ValueError(f"--quantize asks for {name(flagged)} but the config's {section} says quantize: "
                         f"{target.quantize} ({name(configured)}); drop --quantize to export the config's scheme, "
                         "or make the two agree")
    return flagged


def check_can_create(out: Path) -> None:
    """Create and remove a directory where the export writes its temporary one, before any model
    loads: ``os.access`` passes where creating fails (root under /sys, a read-only bind mount)."""
    parent = next(p for p in out.absolute().parents if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.probe-"))
    except OSError as exc:
        fail(f"--out {out}: cannot create it under {parent} ({exc.strerror or exc})")


@export_app.command("check")
def export_check(
    directory: Path = typer.Argument(..., help="An export directory (with manifest.json)."),
    gamma: int = typer.Option(5, "--gamma", min=1, max=64, help="Check N = 1..gamma+1 new nodes."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Allowed max|diff| relative to max|reference| "
                                                               "for every output compared (logits, hidden, "
                                                               "features; default: by each graph's dtype and "
                                                               "case, see docs/runtimes/onnxruntime.md; "
                                                               "quantized graphs: QUANT_RTOL_BITS of "
                                                               "exporters/parity.py, by the scheme's bits, against "
                                                               "fp32 on real inputs, "
                                                               "and a logits scale bound --rtol does not change)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", min=1,
                                       help="Greedy speculative tokens compared (capped, with a note, at what the "
                                            "graph's context leaves after the check's prompt)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS,
                                           help="ONNX Runtime intra-op threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    graph: list[str] = typer.Option([], "--graph", help="Only check this graph (repeatable; default: all)."),
) -> None:
    """ONNX Runtime vs PyTorch on random and real inputs; exit 1 on any mismatch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_finite(rtol, "--rtol")  # nan fails every case, inf passes every one
    if rtol is not None and rtol <= 0:
        fail(f"--rtol {rtol}: give a tolerance above 0")
    from spec_plugins.exporters.parity import check_export

    try:
        report = check_export(directory, gamma, rtol, max_new_tokens, threads, log=_log, only=graph or None)
    except (ValueError, FileNotFoundError, LookupError, ImportError) as exc:
        fail(exc)
        return
    typer.echo(json.dumps(report.to_dict(), allow_nan=False) if as_json else report.format())
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

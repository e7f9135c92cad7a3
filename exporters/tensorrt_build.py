"""Build TensorRT engines from an ONNX export (``spec-plugins export tensorrt``).

For every decoder graph of the export (``verify``, ``draft``): parse the ONNX file with
TensorRT's ONNX parser, add the ``decode`` and ``prefill`` optimisation profiles computed by
``tensorrt_profiles.profiles``, set the precision flags and serialise the plan. The plans are
written with a manifest recording the TensorRT version, GPU and profiles, so the runtime can
refuse plans built elsewhere. Everything is written to a temporary directory first, so a
failed build never leaves a half-written engine directory behind (nor the parents of ``--out``
it created); ``--out`` is replaced only when it is new, empty or a previous engine directory
(the ONNX export's own rules, ``check_out_dir``).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from spec_plugins.graphs.engines import (FORMAT, HARDWARE_COMPAT, MANIFEST_NAME, BuildEnv, EngineEntry,
                                         EngineManifest, EngineManifestError, file_sha256)
from spec_plugins.graphs.io import GRAPH_DTYPES
from spec_plugins.graphs.profiles import Limits, Profile, ProfileError, check_graph, profiles

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """TensorRT could not parse or build a graph (its own log says more)."""


def _quiet(_: str) -> None:
    pass


def network_flags(trt: Any) -> int:
    """TensorRT 10 networks are always explicit-batch (the flag is deprecated); 8.x needs it."""
    if int(trt.__version__.split(".")[0]) >= 10:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)


def check_precision(trt: Any, precision: str, graph_dtypes: Sequence[str]) -> None:
    """Refuse --fp16 / --bf16 before anything is built where this TensorRT has no such builder flag.
    TensorRT 11 dropped BuilderFlag.FP16 / BF16: its networks are always strongly typed, so an
    engine computes in the dtype of the ONNX graph it was parsed from."""
    flag = {"fp16": "FP16", "bf16": "BF16"}.get(precision)
    if flag is None or hasattr(trt.BuilderFlag, flag):
        return
    if hasattr(trt.BuilderFlag, "FP16"):  # 8.x: weakly typed, but bf16 came in 9
        raise BuildError(f"--bf16 needs TensorRT >= 9 (installed: {trt.__version__})")
    have = ", ".join(sorted(set(graph_dtypes))) or "none"
    if precision == "fp16":
        how = ("Export the ONNX graphs in float16 instead (set `dtype: float16` on the target, and on a draft "
               "model, in the config of `spec-plugins export onnx --config CONFIG --out DIR`), then build "
               "them without --fp16")
    else:
        how = (f"`spec-plugins export onnx` writes {' or '.join(GRAPH_DTYPES)} graphs only, so this TensorRT "
               "cannot build bfloat16 engines from them; export in float16 (`dtype: float16` in the config) "
               "and build without --bf16, or build with TensorRT 10 and --bf16")
    raise BuildError(f"--{precision}: TensorRT {trt.__version__} has no BuilderFlag.{flag}; it builds strongly "
                     f"typed networks that take their precision from the ONNX graph's dtype (these graphs: "
                     f"{have}). {how}.")


def set_precision(trt: Any, config: Any, precision: str) -> None:
    """fp32: strict (no TF32, so greedy tokens match PyTorch fp32); tf32: TensorRT's default;
    fp16 / bf16: reduced-precision kernels allowed where TensorRT finds them faster (flags only
    TensorRT <= 10 has: ``build_engines`` runs ``check_precision`` first)."""
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)
    elif precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    elif precision != "tf32":
        raise ProfileError(f"unknown precision {precision!r}")


def check_network_io(network_inputs: Sequence[str], network_outputs: Sequence[str], graph: Any) -> None:
    """The parsed network must expose exactly the manifest's tensors (else profiles miss inputs)."""
    want_in = [t["name"] for t in graph.inputs]
    want_out = [t["name"] for t in graph.outputs]
    if sorted(network_inputs) != sorted(want_in) or sorted(network_outputs) != sorted(want_out):
        raise BuildError(f"graph {graph.name!r}: the ONNX file has inputs {list(network_inputs)} and outputs "
                           f"{list(network_outputs)}, the manifest lists {want_in} and {want_out}; export again")


def set_hardware_compat(trt: Any, config: Any, level: str) -> None:
    """Ask for plans that run on other GPUs too (at some speed cost); "none" = this GPU only."""
    if level not in HARDWARE_COMPAT:
        raise ProfileError(f"unknown hardware compatibility {level!r} (known: {', '.join(HARDWARE_COMPAT)})")
    if level == "none":
        return
    member = getattr(getattr(trt, "HardwareCompatibilityLevel", None), HARDWARE_COMPAT[level], None)
    if member is None:
        raise ProfileError(f"TensorRT {trt.__version__} has no hardware compatibility level {HARDWARE_COMPAT[level]}")
    config.hardware_compatibility_level = member


def check_engine_out(onnx_dir: Path, out: Path) -> None:
    """Refuse an ``--out`` the build must not replace: the ONNX export it reads (or a directory
    holding it), and whatever ``check_out_dir`` refuses (the current directory, one above it, a
    directory of other files); a previous engine directory is replaced."""
    from spec_plugins.exporters.onnx_export import check_out_dir, holds_manifest

    src, target = onnx_dir.resolve(), out.resolve()
    if target == src or target in src.parents:
        raise ValueError(f"--out {out} is the ONNX export {onnx_dir} or holds it; give a new directory for the "
                         "engines (its contents would be replaced)")
    engines = partial(holds_manifest, name=MANIFEST_NAME, error=EngineManifestError, fmt=FORMAT)
    check_out_dir(out, engines, f"TensorRT engines ({MANIFEST_NAME})")


def check_workspace(workspace_gib: float | None) -> None:
    """``--workspace-gib`` is unset or a finite size of at least one byte: TensorRT takes whole
    bytes, so 0 would be dropped, a negative size wrap around and nan or inf fail deep in a build."""
    if workspace_gib is not None and (not math.isfinite(workspace_gib) or int(workspace_gib * 2**30) < 1):
        raise ValueError(f"--workspace-gib {workspace_gib}: give a finite workspace size above 0 (in GiB, at least "
                         "one byte), or leave it out for TensorRT's default")


def default_context(man: Any, graphs: Sequence[str] | None = None) -> int:
    """``--max-context`` when not given: min(2048, the positions of every decoder graph to build).
    Head graphs hold no positions of their own (their max_context is 0) and are not built."""
    return min([2048] + [g.max_context for g in man.graphs
                         if g.kind == "decoder_with_past" and (graphs is None or g.name in graphs)])


def build_plan(trt: Any, onnx_path: Path, graph: Any, profs: Sequence[Profile], precision: str,
               workspace_gib: float | None, log: Log, hardware_compat: str = "none") -> bytes:
    """Parse one ONNX graph and return the serialised engine."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # by path: external weight files resolve too
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    check_network_io([network.get_input(i).name for i in range(network.num_inputs)],
                     [network.get_output(i).name for i in range(network.num_outputs)], graph)
    config = builder.create_builder_config()
    if workspace_gib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    set_precision(trt, config, precision)
    set_hardware_compat(trt, config, hardware_compat)
    for prof in profs:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.shapes(graph.inputs).items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    log(f"  building {graph.name} ({precision}, profiles {', '.join(p.name for p in profs)}) ...")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT failed to build an engine for {graph.name!r} (see its log above)")
    return bytes(plan)


def build_engines(onnx_dir: str | Path, out: str | Path, precision: str = "fp32", limits: Limits | None = None,
                  graphs: Sequence[str] | None = None, workspace_gib: float | None = None,
                  log: Log = _quiet, hardware_compat: str = "none") -> EngineManifest:
    """Build plans for the decoder graphs of ``onnx_dir`` into ``out`` (a new or empty directory or
    previous engines: ``check_engine_out``; replaced atomically)."""
    from spec_plugins.backends.tensorrt_runtime import cuda_device, import_tensorrt
    from spec_plugins.graphs.manifest import MANIFEST_NAME as ONNX_MANIFEST
    from spec_plugins.graphs.manifest import Manifest

    from spec_plugins.exporters.staging import move_into_place, staged

    onnx_dir, out = Path(onnx_dir), Path(out).absolute()
    check_workspace(workspace_gib)
    check_engine_out(onnx_dir, out)
    if hardware_compat not in HARDWARE_COMPAT:
        raise ProfileError(f"unknown hardware compatibility {hardware_compat!r} (known: {', '.join(HARDWARE_COMPAT)})")
    man = Manifest.read(onnx_dir)
    limits = limits or Limits()
    chosen, skipped = chosen_graphs(man, onnx_dir, graphs, limits)  # before TensorRT: a bad flag is named first
    profs = profiles(limits)
    trt = import_tensorrt()
    check_precision(trt, precision, [g.dtype for g in chosen])
    cuda_device("cuda")
    env = BuildEnv.current()
    with staged(out) as tmp:
        log(f"TensorRT {env.tensorrt_version} on {env.gpu_name} (sm {env.compute_capability[0]}"
            f"{env.compute_capability[1]})")
        entries = []
        for g in chosen:
            t0 = time.perf_counter()
            plan = build_plan(trt, onnx_dir / g.file, g, profs, precision, workspace_gib, log, hardware_compat)
            name = f"{g.name}.plan"
            (tmp / name).write_bytes(plan)
            secs = time.perf_counter() - t0
            log(f"  {name}: {len(plan) / 2**20:.1f} MiB in {secs:.1f} s")
            model = {k: getattr(g, k) for k in ("num_layers", "num_kv_heads", "head_dim", "hidden_size",
                                                "vocab_size", "max_context", "dtype", "source_model",
                                                "feature_layers")}
            entries.append(EngineEntry(name=g.name, plan=name, onnx_file=g.file, sha256=file_sha256(tmp / name),
                                       size_bytes=len(plan), build_seconds=round(secs, 3),
                                       profiles=[p.to_dict() for p in profs], inputs=g.inputs, outputs=g.outputs,
                                       model=model))
        tok = None
        if man.tokenizer and (onnx_dir / man.tokenizer).is_dir():
            shutil.copytree(onnx_dir / man.tokenizer, tmp / "tokenizer")
            tok = "tokenizer"
        em = EngineManifest(engines=entries, built_with=env.to_dict(), precision=precision, limits=limits.to_dict(),
                            onnx_manifest_sha256=file_sha256(onnx_dir / ONNX_MANIFEST), tokenizer=tok,
                            eos_token_ids=list(man.eos_token_ids), skipped=skipped,
                            hardware_compatibility=hardware_compat)
        em.write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the ONNX export's directory is 0755 too
        move_into_place(tmp, out)
        return em


def chosen_graphs(man: Any, onnx_dir: Path, graphs: Sequence[str] | None, limits: Limits
                  ) -> tuple[list[Any], list[str]]:
    """The decoder graphs of ``man`` to build (``graphs``: those named) and why others are skipped;
    a ProfileError where none is left or ``limits`` exceed a graph's positions. Needs no TensorRT."""
    skipped = [f"{g}: not in the export" for g in (graphs or []) if g not in {x.name for x in man.graphs}]
    for g in man.graphs:
        if g.kind != "decoder_with_past":
            skipped.append(f"{g.name}: {g.kind} graphs are not built for TensorRT yet (only decoder graphs "
                           "have a TensorRT runtime)")
    chosen = [g for g in man.graphs if (graphs is None or g.name in graphs) and g.kind == "decoder_with_past"]
    if not chosen:
        raise ProfileError(f"no decoder graph to build in {onnx_dir} ({'; '.join(skipped) or 'empty export'})")
    for g in chosen:
        check_graph(g.inputs, g.outputs, g.name)
        if limits.max_context > g.max_context:
            raise ProfileError(f"--max-context {limits.max_context} exceeds the {g.max_context} positions of "
                               f"graph {g.name!r} ({g.source_model})")
    return chosen, skipped


def precision_of(fp16: bool, bf16: bool, tf32: bool) -> str:
    """CLI flags -> one precision name; contradictory flags are refused."""
    chosen = [n for n, on in (("fp16", fp16), ("bf16", bf16), ("tf32", tf32)) if on]
    if len(chosen) > 1:
        raise ProfileError(f"choose one precision flag, got {', '.join('--' + c for c in chosen)}")
    return chosen[0] if chosen else "fp32"


def add_command(export_app: Any) -> None:
    """Register ``tensorrt`` on the ``spec-plugins export`` sub-app."""
    import typer

    @export_app.command("tensorrt")
    def tensorrt_cmd(
        onnx: Path = typer.Option(..., "--onnx", help="Directory written by `spec-plugins export onnx`."),
        out: Path = typer.Option(..., "--out", help="Engine directory to write: a new or empty one, or previous "
                                                    "engines (replaced); anything else is refused."),
        fp16: bool = typer.Option(False, "--fp16", help="Allow fp16 kernels (TensorRT <= 10; 11 takes the "
                                                        "precision from the ONNX graph's dtype)."),
        bf16: bool = typer.Option(False, "--bf16", help="Allow bf16 kernels (TensorRT 9 and 10)."),
        tf32: bool = typer.Option(False, "--tf32", help="Allow TF32 matmuls (default: strict fp32)."),
        max_batch: int = typer.Option(1, "--max-batch", help="Largest batch the engines take."),
        max_draft: int = typer.Option(8, "--max-draft",
                                      help="Most draft nodes per step, tree nodes included (a step runs N + 1)."),
        max_context: Optional[int] = typer.Option(None, "--max-context",
                                                  help="Positions held (default: min(2048, the model's))."),
        prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="Prompt tokens per prefill call."),
        graph: list[str] = typer.Option([], "--graph", help="Build only these graphs (repeatable)."),
        workspace_gib: Optional[float] = typer.Option(None, "--workspace-gib",
                                                      help="Builder workspace limit in GiB (above 0)."),
        hardware_compat: str = typer.Option("none", "--hardware-compat",
                                            help="none (this GPU), same_cc (same compute capability) or ampere_plus."),
    ) -> None:
        """Build TensorRT engines (plans + manifest) from an ONNX export; needs tensorrt and a GPU."""
        from spec_plugins.cli import fail
        from spec_plugins.graphs.manifest import Manifest, ManifestError
        from spec_plugins.registry import RegistryError

        try:
            check_workspace(workspace_gib)  # before the ONNX export is read
            precision = precision_of(fp16, bf16, tf32)
            ctx = max_context
            if ctx is None:
                ctx = default_context(Manifest.read(onnx), graph or None)
            limits = Limits(max_batch=max_batch, max_draft=max_draft, max_context=ctx,
                            prefill_chunk=min(prefill_chunk, ctx))
            em = build_engines(onnx, out, precision, limits, graph or None, workspace_gib, log=typer.echo,
                               hardware_compat=hardware_compat)
        except (ValueError, BuildError, ManifestError, RegistryError, FileNotFoundError) as exc:
            fail(exc)
            return
        typer.echo(f"wrote {len(em.engines)} engine(s) to {out}" + (f"; skipped: {'; '.join(em.skipped)}"
                                                                     if em.skipped else ""))

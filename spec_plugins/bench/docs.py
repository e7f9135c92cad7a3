"""Bench reports into ``docs/benchmarks.md``: one section per run, with the machine, the date,
the command and the plots, replaced in place when the same title is written again, so the page
is regenerated from reports and never edited by hand."""

from __future__ import annotations

import platform
import re
import shutil
from pathlib import Path

from spec_plugins.bench.plots import PLOTS
from spec_plugins.bench.report import markdown
from spec_plugins.files import write_text_atomic

START, END = "<!-- bench:{} -->", "<!-- /bench:{} -->"


def local(text: str) -> str:
    """Absolute paths of this machine shortened to their last component (committed pages hold none)."""
    return re.sub(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)", r"\1", text)


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "run"


# CPU features that decide which kernels run (int8 dot products, AMX tiles): two CPUs with the
# same model string can differ in them, and quantized timings depend on them.
_ISA = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx_vnni", "AVX-VNNI"),
        ("amx_int8", "AMX-INT8"))


def machine() -> str:
    """The CPU model, its vector extensions and core count, as the report's readers need it."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    import os

    isa = " ".join(name for flag, name in _ISA if flag in flags)
    return f"{model}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores, {platform.system()}"


def section(report: dict, title: str, command: str, out_dir: Path, doc: Path) -> str:
    """The Markdown of one run: header lines, the summary tables and the plots this run wrote
    (``report["files"]``: not every PNG of ``out_dir``, where an earlier run may have left plots this
    one did not draw), copied next to the document so the page is self-contained."""
    meta = report["meta"]
    pngs = _plots(report, Path(out_dir))
    img = doc.parent / "img" / slug(title)
    img.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:  # an earlier run's plot this run did not draw would stay beside the new ones
        (img / name).unlink(missing_ok=True)
    for p in pngs:
        shutil.copy(p, img / p.name)
    body = markdown(report).split("\n", 1)[1].lstrip()  # drop the page title
    body = body.replace("\n## ", "\n#### ")
    lines = [f"## {title}", "", f"- machine: {meta.get('machine_detail') or machine()}",
             f"- date: {meta.get('started_utc', '')[:10]}", f"- command: `{local(command)}`", "", local(body)]
    lines += [f"![{p.stem}](img/{slug(title)}/{p.name})" for p in pngs]
    return "\n".join(lines).rstrip() + "\n"


def _plots(report: dict, out_dir: Path) -> list[Path]:
    """The PNGs this run wrote into ``out_dir``, in name order; a report without its files list
    (a run without ``out``) or whose plots are gone is refused, naming why."""
    if "files" not in report:
        raise ValueError("the report lists no files: section() embeds the plots its run wrote (run_bench(..., out=))")
    pngs = sorted(out_dir / Path(f).name for f in report["files"] if Path(f).suffix == ".png")
    missing = [p.name for p in pngs if not p.is_file()]
    if missing:
        raise ValueError(f"the report's plots are not in {out_dir}: {', '.join(missing)}")
    return pngs


def check_title(doc: Path, title: str) -> None:
    """Sections are found by the slug of their title: a different title with the same slug (e.g.
    "Dev prompts (ORT)" and "Dev prompts, ORT") would replace that section, so it is refused, naming
    both (the section's first line is ``## <title>``, as ``section`` writes it)."""
    s = START.format(slug(title))
    old = doc.read_text() if doc.exists() else ""
    if s not in old:
        return
    head = old[old.index(s) + len(s):].lstrip("\n").split("\n", 1)[0]
    if head != f"## {title}":
        raise ValueError(f"title {title!r}: {doc} has a section {head.removeprefix('## ')!r} with the same "
                         f"key {slug(title)!r}, which this title would replace; give a title that differs "
                         "in its letters or digits (or the same title to replace that section)")


def update(doc: Path, title: str, text: str) -> None:
    """Replace the section of ``title`` in ``doc`` (or append it); another title with the same
    slug is refused (``check_title``). The page holds every other run's section, so it is
    replaced whole (``write_text_atomic``): a failed write leaves the old page."""
    check_title(doc, title)
    s, e = START.format(slug(title)), END.format(slug(title))
    block = f"{s}\n{text}{e}\n"
    old = doc.read_text() if doc.exists() else "# Benchmarks\n\nGenerated from bench reports by `spec-plugins bench ... --markdown docs/benchmarks.md --title ...`; do not edit by hand.\n\n"
    if s in old and e in old:
        new = old[: old.index(s)] + block + old[old.index(e) + len(e) + 1:]
    else:
        new = old.rstrip() + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(doc, new)

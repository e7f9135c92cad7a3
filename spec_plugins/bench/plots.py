"""PNG plots of a bench report (matplotlib, headless). Each reads only the report dict."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plain_text(text: str) -> str:
    """``text`` (a token, a method name, a category) shown as written: matplotlib reads a text
    with two unescaped ``$`` as mathtext (a token ``$$`` fails to parse), an escaped one is a
    literal ``$``."""
    return text.replace("$", r"\$")


def _ours(report: dict) -> list[dict]:
    """Our methods: fixed draft lengths, auto, and other proposers (``--methods``)."""
    return [m for m in report["methods"] if m["kind"] in ("ours", "method")]


def _is_ours_auto(m: dict) -> bool:
    """Our ``auto`` method (not another proposer or runtime that also drafts ``auto``)."""
    from spec_plugins.bench.methods import ours_name

    return m["kind"] == "ours" and m["name"] == ours_name("auto")


def _label(m: dict) -> str:
    """A method's legend entry: our draft lengths by γ, our auto as "auto", the rest by name."""
    if _is_ours_auto(m):
        return "auto"
    return f"γ = {m['gamma']}" if m["kind"] == "ours" else plain_text(m["name"])


def acceptance_by_position(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    ours = _ours(report)
    cmap = plt.get_cmap("viridis")
    others = [m for m in ours if not _is_ours_auto(m)]
    # auto is drawn black: the colour map spans the other methods only
    colour = {m["name"]: cmap(i / max(1, len(others) - 1)) for i, m in enumerate(others)}
    for m in ours:
        s = report["summary"][m["name"]]["all"]["stats"]
        rates = [a for a, rows in zip(s["acceptance_by_position"], s["rows_by_position"]) if rows]
        if not rates:
            continue
        xs = range(1, len(rates) + 1)
        if _is_ours_auto(m):
            ax.plot(xs, rates, "k--o", label=_label(m), markersize=4)
        else:
            ax.plot(xs, rates, "-o", color=colour[m["name"]], label=_label(m), markersize=4)
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("acceptance rate (of the rows that drafted a position, share accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position, all prompts")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8, ncol=2)
    else:
        ax.text(0.5, 0.5, "nothing was drafted", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_by_category(report: dict, path: Path) -> None:
    """Heatmap: method x category, speedup over plain written in each cell."""
    import numpy as np

    methods = [m["name"] for m in report["methods"] if m["name"] != "plain"]
    cats = report["categories"]
    data = np.array([[report["summary"][m][c]["speedup"] or 0.0 for c in cats] for m in methods])
    fig, ax = plt.subplots(figsize=(1.2 * len(cats) + 3, 0.45 * len(methods) + 2))
    from matplotlib.colors import TwoSlopeNorm

    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(float(data.min()), 0.95), vmax=max(float(data.max()), 1.05))
    im = ax.imshow(data, cmap="RdYlGn", norm=norm, aspect="auto")  # red: slower than plain, green: faster
    for i in range(len(methods)):
        for j in range(len(cats)):
            ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(cats)), [plain_text(c) for c in cats], rotation=30, ha="right")
    ref = {m["name"]: m.get("speedup_reference", "plain") for m in report["methods"]}
    ax.set_yticks(range(len(methods)), [plain_text(m if ref.get(m, "plain") == "plain" and "@" not in m
                                                   else f"{m} (vs {ref[m]})") for m in methods])
    ax.set_xlabel("prompt category")
    ax.set_ylabel("method")
    ax.set_title("Speedup over plain decoding (tokens/s ratio)")
    fig.colorbar(im, ax=ax, label="speedup over plain (×)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_vs_theory(report: dict, path: Path) -> None:
    th = report["theory"]
    fig, ax = plt.subplots(figsize=(8, 6.2))
    g = th["gammas"]
    ax.plot(g, th["ideal"], "-", color="tab:blue",
            label=f"S(γ) = (1−α^(γ+1)) / ((1−α)(1+γc)), α={th['alpha']:.2f}, c={th['c']:.3f}")
    ax.plot(g, th["with_verify_cost"], "-", color="tab:orange", label="same, divided by measured verify cost T(γ+1)/T(1) (as if every round drafted γ)")
    meas = sorted((int(k), v) for k, v in th["measured"].items() if v is not None)
    if meas:
        ax.plot([x for x, _ in meas], [y for _, y in meas], "ko", label="measured (ours, fixed γ)")
    if th.get("measured_auto") is not None:
        ax.axhline(th["measured_auto"], color="tab:green", ls="--", label="measured (ours, auto)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft length γ")
    ax.set_ylabel("speedup over plain decoding (×)")
    ax.set_title("Measured speedup against the theoretical S(γ)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below: never over the data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rejected_tokens(report: dict, path: Path, top: int = 20) -> None:
    rows = report["most_rejected_tokens"][:top]
    fig, ax = plt.subplots(figsize=(8, 0.3 * max(len(rows), 3) + 1.5))
    if rows:
        labels = [plain_text(repr(r["text"])) for r in rows][::-1]
        ax.barh(range(len(rows)), [r["count"] for r in rows][::-1], color="tab:red")
        ax.set_yticks(range(len(rows)), labels, fontsize=9)
    else:
        ax.text(0.5, 0.5, "no rejected draft tokens", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("times rejected (all our methods, all prompts)")
    ax.set_ylabel("drafted token")
    ax.set_title("Most often rejected draft tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_model(report: dict, path: Path) -> None:
    cm = report["cost_model"]
    t1 = cm["target_seconds"][0]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(cm["positions"], cm["target_relative"], "o-", color="tab:blue",
            label="fastest of the repeats, unsmoothed (what auto prices, corrected online)")
    ax.set_xlabel("new positions N in one target forward (warm cache)")
    ax.set_ylabel(f"cost relative to N = 1  (T(1) = {t1 * 1e3:.1f} ms)")
    ax.set_title(plain_text(f"Target forward cost on the {cm['runtime']} runtime"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {
    "acceptance_by_position.png": acceptance_by_position,
    "speedup_by_category.png": speedup_by_category,
    "speedup_vs_theory.png": speedup_vs_theory,
    "rejected_tokens.png": rejected_tokens,
    "cost_model.png": cost_model,
}


class PlotError(RuntimeError):
    """Plots that could not be drawn; raised after the report listing them was written."""


def _why(exc: BaseException) -> str:
    """One line for a plot's error (matplotlib's parse errors span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def write_plots(report: dict, out: Path) -> tuple[list[Path], dict[str, str]]:
    """Every plot the report has data for: the files written, and per plot that failed its error
    (its figure closed, no file of it left), so one broken plot costs neither the others nor the
    report's numbers."""
    from spec_plugins.bench.report import has_theory

    paths, failed = [], {}
    for name, fn in PLOTS.items():
        if fn is speedup_vs_theory and not has_theory(report):
            continue
        before = set(plt.get_fignums())
        try:
            fn(report, out / name)
        except Exception as exc:  # noqa: BLE001 - matplotlib raises many kinds; recorded, raised after the report
            failed[name] = _why(exc)
            for num in set(plt.get_fignums()) - before:
                plt.close(num)
            (out / name).unlink(missing_ok=True)
            continue
        paths.append(out / name)
    return paths, failed

"""The sweep's markdown report and matplotlib figures (paper figures 4 and 5, on replayed traces)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contextrender_eval.evaluate import AGE_BINS, Prices, VariantStats
from contextrender_eval.replay import markdown_table, summarise

# Plot order and styles: baselines dashed, ContextRender variants solid.
STYLE = {
    "full": ("black", ":", "o"),
    "prune": ("tab:gray", "--", "s"),
    "semantic": ("tab:olive", "--", "^"),
    "recency-summary": ("tab:brown", "--", "v"),
    "compact": ("tab:pink", "--", "D"),
    "cr-recency": ("tab:cyan", "-", "<"),
    "cr-relevance": ("tab:purple", "-", ">"),
    "cr-recency-relevance": ("tab:blue", "-", "P"),
    "contextrender": ("tab:red", "-", "*"),
}


def dataset_rows(saved: dict, prices: Prices) -> list[dict]:
    stats = {(d["selector"], d["budget"]): VariantStats.from_dict(d) for d in saved["stats"]}
    rows = summarise(stats, prices)
    order = list(STYLE)
    return sorted(rows, key=lambda r: (r["budget"], order.index(r["selector"]) if r["selector"] in order else 99))


def _figures(rows_by_dataset: dict[str, list[dict]], out: Path) -> tuple[Path, Path, Path]:
    def by_budget(ax, selector: str, rows: list[dict], style: dict) -> None:
        points = sorted((r["budget"], r["recall"]) for r in rows)
        ax.plot([p[0] / 1000 for p in points], [p[1] for p in points], **style)

    def by_ratio(key: str) -> Any:
        def draw(ax, selector: str, rows: list[dict], style: dict) -> None:
            points = [(r[key], r["recall"], r["budget"]) for r in sorted(rows, key=lambda r: r["budget"])
                      if r.get(key, float("nan")) == r.get(key, float("nan"))]
            ax.plot([p[0] for p in points], [p[1] for p in points], **style, alpha=0.9)
            if selector == "contextrender":
                for x, y, b in points:
                    ax.annotate(f"{b // 1000}K", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7, color=style["color"])
        return draw

    def budget_axis(ax, rows: list[dict]) -> None:
        budgets = sorted({r["budget"] for r in rows})
        ax.set_xticks([b / 1000 for b in budgets])
        ax.set_xticklabels([f"{b // 1000}K" for b in budgets])
        ax.set_xlabel("history budget B")

    def cost_axis(ax, rows: list[dict]) -> None:
        ax.set_xlabel("mean cost / full history (equation 3, rho from full)")

    def cached_axis(ax, rows: list[dict]) -> None:
        ax.set_xlabel("mean cost / full history (each method's own prefix cache)")
        ax.axvline(1.0, color="black", linewidth=0.6, linestyle=":")

    budget_png = _panels(rows_by_dataset, by_budget, budget_axis, True,
                         "Recall vs history budget (replayed traces; cf. paper figure 5)", out / "recall_vs_budget.png")
    cost_png = _panels(rows_by_dataset, by_ratio("ratio_eq3"), cost_axis, False,
                       "Recall vs normalised cost, tasks that need management (cf. paper figure 4)", out / "recall_vs_cost.png")
    cached_png = _panels(rows_by_dataset, by_ratio("ratio_cached"), cached_axis, False,
                         "Recall vs cost priced with each method's own prefix cache, tasks that need management",
                         out / "recall_vs_cached_cost.png")
    return budget_png, cost_png, cached_png


def _panels(rows_by_dataset: dict[str, list[dict]], draw: Any, x_axis: Any, with_events: bool, title: str, path: Path) -> Path:
    """One panel per trace set, one line per selector (recall on y), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows_by_dataset)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = rows_by_dataset[name]
        for selector, (color, line, marker) in STYLE.items():
            mine = [r for r in rows if r["selector"] == selector]
            if mine:
                style = {"color": color, "linestyle": line, "marker": marker, "label": selector,
                         "linewidth": 2.2 if selector == "contextrender" else 1.3}
                draw(ax, selector, mine, style)
        x_axis(ax, rows)
        ax.set_ylabel("Later-Used Result Recall (%)")
        ax.set_ylim(0, 102)
        events = f" ({rows[0]['events']} reuse events)" if with_events and rows else ""
        ax.set_title(f"{name}{events}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(datasets: dict[str, dict], out: Path, prices: Prices, command: str) -> Path:
    rows_by_dataset = {name: dataset_rows(saved, prices) for name, saved in datasets.items()}
    budget_png, cost_png, cached_png = _figures(rows_by_dataset, out)
    lines = [
        "# Replay sweep: recall, tokens and cost on the recorded traces",
        "",
        f"Command: `{command}`",
        "",
        "Recall is Later-Used Result Recall (paper B.4) at every assistant turn of each trace: events are",
        "(turn, result) pairs whose token first appeared in that result; a result counts as visible only when",
        "its complete original text is in the rendered context. Age = model invocations between the result's",
        f"call and its reuse (bins {', '.join(n for n, _, _ in AGE_BINS)}). Tokens are per invocation: history",
        "(within B) and the complete input (system + history + current message). `managed %` = renders whose",
        "full history exceeded B. Costs are means per trace over the traces whose full history exceeded B before",
        "some invocation (C.1), as ratios to `full`: `cost eq3/full` prices every method with rho = full's",
        "simulated cache rate (equation 3 as the paper prices it); `cost cache/full` prices each method with its",
        "own simulated prefix cache (leading messages identical to the session's previous request); `cache hit %` is",
        "the share of that method's input tokens the cache covered, on the same traces. `re-render %` is the share of",
        "managed renders that re-rendered rather than appended to the previous request (the stable policy). Output tokens",
        "are the recorded assistant turns; summariser calls add their input and output; embedding tokens count",
        "results (first 8,000 chars) and per-render queries for the selectors that embed. Latency is the render",
        "computation (render() inside the walker) over managed renders.",
        "",
        f"Prices (USD per 1M tokens): input {prices.input}, cached input {prices.cached_input}, output {prices.output}, "
        f"embedding {prices.embedding}.",
        "",
        f"![recall vs budget]({budget_png.name})",
        "",
        f"![recall vs cost]({cost_png.name})",
        "",
        f"![recall vs cost with each method's own cache]({cached_png.name})",
        "",
    ]
    for name, saved in datasets.items():
        settings = saved.get("settings", {})
        limit = saved.get("limit", 0)
        lines += [
            f"## {name}",
            "",
            f"{saved['traces']} traces{' (first ' + str(limit) + ' of the file)' if limit else ''}; budgets "
            f"{', '.join(str(b) for b in saved['budgets'])}; summariser `{settings.get('summariser')}`"
            + (" (the offline extractive stand-in, not an LLM)" if settings.get("summariser") == "offline" else "")
            + f"; omitted results: `{settings.get('omitted')}`"
            + "".join(f"; `{k}` = {v}" for k, v in settings.items() if k not in ("summariser", "omitted"))
            + ".",
            "",
            markdown_table(rows_by_dataset[name]),
            "",
        ]
        events = rows_by_dataset[name][0]["events_by_age"] if rows_by_dataset[name] else {}
        lines += ["Reuse events by age: " + ", ".join(f"{k}: {v}" for k, v in events.items()), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report

"""PNG plots drawn from result dicts (so a saved JSON can be re-plotted): latency CDFs of a run, a
sweep's curves against request rate, and bars comparing two results.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas directly: no pyplot global
state, no display needed, whatever backend the caller's process has chosen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

CDF_PANELS = (("ttfts", "TTFT (ms)", "slo_ttft_ms"), ("tpots", "TPOT (ms)", "slo_tpot_ms"),
              ("e2els", "E2E latency (ms)", None))


def save_figure(fig: Figure, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)


def _cdf(ax, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    x = np.sort(np.asarray(values_s) * 1e3)
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def _slo_line(ax, value_ms, vertical: bool = True) -> None:
    if value_ms is None:
        return
    line = ax.axvline if vertical else ax.axhline
    line(value_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {value_ms:g} ms")


def _rate_label(result: dict) -> str:
    rate = result.get("request_rate")
    return f"{rate:g} req/s" if isinstance(rate, (int, float)) else str(rate)


def _draw_cdfs(axes, results: list[dict], labels: list[str]) -> None:
    for ax, (key, title, slo_key) in zip(axes, CDF_PANELS):
        for result, label in zip(results, labels):
            _cdf(ax, result.get(key) or [], label)
        _slo_line(ax, results[0].get(slo_key) if slo_key else None)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"CDF of {title.split(' (')[0]}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)


def plot_run(result: dict, path: str | Path) -> None:
    fig = Figure(figsize=(13, 4))
    _draw_cdfs(fig.subplots(1, 3), [result], [_rate_label(result)])
    fig.suptitle(f"{result.get('label') or result.get('model_id', '')}: {result.get('completed')} requests, "
                 f"goodput {result.get('request_goodput', 0):.2f} req/s")
    fig.tight_layout()
    save_figure(fig, path)


def plot_sweep(results: list[dict], path: str | Path) -> None:
    fig = Figure(figsize=(13, 8))
    axes = fig.subplots(2, 3)
    _draw_cdfs(axes[0], results, [_rate_label(r) for r in results])
    rates = [r["request_rate"] for r in results]

    def curve(ax, keys_labels, ylabel, slo_key=None):
        for key, label in keys_labels:
            ax.plot(rates, [np.nan if r.get(key) is None else r[key] for r in results], marker="o", label=label)
        _slo_line(ax, results[0].get(slo_key) if slo_key else None, vertical=False)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    curve(axes[1][0], (("request_goodput", "goodput"), ("request_throughput", "throughput")), "requests/s")
    curve(axes[1][1], (("p99_ttft_ms", "p99 TTFT"), ("p99_e2el_ms", "p99 E2E")), "ms", "slo_ttft_ms")
    curve(axes[1][2], (("p99_tpot_ms", "p99 TPOT"), ("p99_itl_ms", "p99 ITL")), "ms", "slo_tpot_ms")
    fig.suptitle(f"{results[0].get('label') or results[0].get('model_id', '')}: sweep over request rate")
    fig.tight_layout()
    save_figure(fig, path)


def plot_compare(a: dict, b: dict, names: tuple[str, str], path: str | Path) -> None:
    groups = (("TTFT (ms)", ("mean_ttft_ms", "p99_ttft_ms")), ("TPOT (ms)", ("mean_tpot_ms", "p99_tpot_ms")),
              ("E2E latency (ms)", ("mean_e2el_ms", "p99_e2el_ms")),
              ("requests/s", ("request_throughput", "request_goodput")))
    fig = Figure(figsize=(14, 4))
    width = 0.38
    for ax, (title, keys) in zip(fig.subplots(1, 4), groups):
        x = np.arange(len(keys))
        for i, (result, name) in enumerate(((a, names[0]), (b, names[1]))):
            values = [result.get(k) or 0.0 for k in keys]
            bars = ax.bar(x + (i - 0.5) * width, values, width, label=name)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(x, [k.rsplit("_", 1)[0] if k.endswith("_ms") else k.replace("request_", "")
                          for k in keys], fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(f"{names[0]} vs {names[1]}")
    fig.tight_layout()
    save_figure(fig, path)

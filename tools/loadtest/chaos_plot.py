"""The chaos run's PNG, drawn from a result dict (a saved JSON re-plots): over time, output tokens/s
and requests/s, each request's TTFT at its send time (failures marked), and the workers /health
listed healthy per role; every event is a vertical line (a stop shades until its SIGCONT) and a
dashed line marks when the worker was back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pdcluster.tools.loadtest.plot import save_figure

EVENT_COLORS = {"kill": "tab:red", "stop": "tab:purple"}


def _mark_events(ax, events: list[dict], label: bool) -> None:
    for ev in events:
        fired = ev.get("fired_at_s")
        if fired is None:
            continue
        color = EVENT_COLORS.get(ev.get("action"), "black")
        ax.axvline(fired, color=color, linewidth=1.5, label=ev["spec"] if label else None)
        if ev.get("resumed_at_s") is not None:
            ax.axvspan(fired, ev["resumed_at_s"], color=color, alpha=0.12)
        if ev.get("back_at_s") is not None:
            ax.axvline(ev["back_at_s"], color=color, linestyle="--", linewidth=1,
                       label=f"{ev['spec']}: back" if label else None)


def plot_chaos(result: dict, path: str | Path) -> None:
    chaos = result["chaos"]
    events, line, reqs, health = chaos["events"], chaos["timeline"], chaos["requests"], chaos["health"]
    fig = Figure(figsize=(14, 9))
    ax_tp, ax_ttft, ax_workers = fig.subplots(3, 1, sharex=True)

    t = np.asarray(line["t_s"]) + line["bin_s"] / 2
    ax_tp.plot(t, line["output_tokens_per_s"], color="tab:blue", label="output tokens/s (streamed)")
    ax_tp.set_ylabel("output tokens/s")
    ax_req = ax_tp.twinx()
    ax_req.step(t, line["completed_ok_per_s"], where="mid", color="tab:gray", label="requests/s completed OK")
    ax_req.step(t, line["good_per_s"], where="mid", color="tab:green", label="requests/s within SLO")
    ax_req.step(t, line["failed_per_s"], where="mid", color="black", linestyle=":", label="requests/s failed")
    ax_req.set_ylabel("requests/s")
    ax_req.set_ylim(bottom=0, top=max(1.0, max(line["completed_ok_per_s"] + line["failed_per_s"], default=0) * 1.1))
    ax_tp.set_ylim(bottom=0)
    _mark_events(ax_tp, events, label=True)
    handles = ax_tp.get_legend_handles_labels()
    more = ax_req.get_legend_handles_labels()
    ax_tp.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="upper left", bbox_to_anchor=(1.07, 1.0))
    ax_tp.grid(alpha=0.3)

    send = np.asarray(reqs["send_s"], dtype=float)
    ttft = np.asarray([np.nan if x is None else x for x in reqs["ttft_ms"]], dtype=float)
    ok = np.asarray(reqs["ok"], dtype=bool)
    good = np.asarray(reqs["good"], dtype=bool)
    ax_ttft.scatter(send[good], ttft[good], s=8, color="tab:green", label="OK, within SLO")
    ax_ttft.scatter(send[ok & ~good], ttft[ok & ~good], s=8, color="tab:orange", label="OK, missed SLO")
    if (~ok).any():
        top = np.nanmax(ttft) if np.isfinite(ttft).any() else 1.0
        ax_ttft.scatter(send[~ok], np.full((~ok).sum(), top * 1.1), marker="x", color="tab:red", label="failed")
    if result.get("slo_ttft_ms") is not None:
        ax_ttft.axhline(result["slo_ttft_ms"], color="red", linestyle=":", linewidth=1,
                        label=f"TTFT SLO {result['slo_ttft_ms']:g} ms")
    _mark_events(ax_ttft, events, label=False)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms), at send time")
    ax_ttft.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.07, 1.0))
    ax_ttft.grid(alpha=0.3)

    ht = [h["t_s"] for h in health]
    for role, color in (("prefill", "tab:brown"), ("decode", "tab:cyan")):
        if any(h["total"].get(role) for h in health):
            ax_workers.step(ht, [h["healthy"].get(role, 0) for h in health], where="post", color=color,
                            label=f"{role} workers healthy (/health)")
    _mark_events(ax_workers, events, label=False)
    ax_workers.set_ylabel("workers")
    ax_workers.set_xlabel("seconds since the first request")
    ax_workers.set_ylim(bottom=0)
    ax_workers.yaxis.get_major_locator().set_params(integer=True)
    ax_workers.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.07, 1.0))
    ax_workers.grid(alpha=0.3)

    fig.suptitle(f"{result.get('label') or result.get('model_id', '')}: chaos {chaos['spec']} - goodput "
                 f"{result.get('request_goodput', 0):.2f} req/s, "
                 f"SLO attainment {result.get('slo_attainment') or 0:.0%}, {result.get('failed', 0)} failed")
    fig.tight_layout()
    save_figure(fig, path)

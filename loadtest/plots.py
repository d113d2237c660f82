"""PNG figures of a report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

COLORS = {"http": "tab:blue", "ws": "tab:orange", "elevenlabs": "tab:green"}
LABELS = {"http": "HTTP POST /v1/audio/speech (pcm)", "ws": "WebSocket (LLM-paced text)",
          "elevenlabs": "ElevenLabs multi-stream-input (LLM-paced text)"}


def _level_ticks(ax, mode: str, positions, levels: list[float]) -> None:
    """The x axis of levels: its label, and a tick at each position named by its level."""
    ax.set_xlabel("concurrent streams" if mode == "concurrency" else "offered load (requests/s)")
    ax.set_xticks(positions)
    ax.set_xticklabels([f"{v:g}" for v in levels])


def _x_axis(ax, mode: str, levels: list[float]) -> None:
    """Levels as x values: log2 scale for concurrency levels spanning 4x or more."""
    if mode == "concurrency" and len(levels) > 1 and min(levels) > 0 and max(levels) / min(levels) >= 4:
        ax.set_xscale("log", base=2)
    _level_ticks(ax, mode, levels, levels)
    ax.minorticks_off()


def _series(levels: list[dict], transport: str, key: str, stat: str):
    xs, ys = [], []
    for s in levels:
        if s["transport"] == transport and s[key].get(stat) is not None:
            xs.append(s["level"])
            ys.append(s[key][stat])
    return xs, ys


def make_plots(report: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    if not levels:
        return []
    mode = report["config"]["mode"]
    transports = [t for t in COLORS if any(s["transport"] == t for s in levels)]
    all_levels = sorted({s["level"] for s in levels})
    demo = ((report.get("server") or {}).get("ready_before") or {}).get("demo")
    where = f"\n{report['config']['url']}" + (" (demo bundle)" if demo else "")
    written = []

    # (a) TTFA distribution per level: box plots with every stream as a dot
    fig, axes = plt.subplots(1, len(transports), figsize=(5.5 * len(transports), 4.5), squeeze=False)
    for ax, transport in zip(axes[0], transports):
        data, pos = [], []
        for lv in all_levels:
            vals = [1000 * r["ttfa_s"] for r in report["streams"]
                    if r["transport"] == transport and r["level"] == lv and r["status"] == "ok" and r["ttfa_s"]]
            if vals:
                data.append(vals)
                pos.append(lv)
        idx = list(range(1, len(data) + 1))
        if data:
            ax.boxplot(data, positions=idx, widths=0.5, whis=(1, 99), showfliers=False)
            for i, vals in zip(idx, data):
                jitter = [i + 0.18 * ((k * 0.618) % 1 - 0.5) for k in range(len(vals))]
                ax.scatter(jitter, vals, s=10, alpha=0.5, color=COLORS[transport], zorder=3)
        _level_ticks(ax, mode, idx, pos)
        ax.set_title(LABELS[transport], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[0]:
        ax.set_ylabel("time to first audio (ms)")
        ax.set_ylim(bottom=0)
    fig.suptitle("Time to first audio per level (box: quartiles and median; whiskers: the data within p1-p99; "
                 f"dots: streams){where}", fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, out / "ttfa_distribution.png", plt))

    # (b) RTF against load
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for transport in transports:
        c = COLORS[transport]
        for key, stat, style, name in (("stream_rtf", "p50", "-o", "delivery RTF p50"),
                                       ("stream_rtf", "p90", "--o", "delivery RTF p90"),
                                       ("gen_rtf", "p50", ":s", "generation RTF p50")):
            xs, ys = _series(levels, transport, key, stat)
            if xs:
                ax.plot(xs, ys, style, color=c, label=f"{transport}: {name}")
    ax.axhline(1.0, color="red", lw=1, alpha=0.7, label="real time (RTF = 1)")
    _x_axis(ax, mode, all_levels)
    ax.set_ylabel("real-time factor (wall s per audio s; < 1 is faster than real time)")
    ax.set_title(f"Real-time factor against load{where}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out / "rtf_vs_concurrency.png", plt))

    # (c) TTFA against load
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for transport in transports:
        c = COLORS[transport]
        for stat, style in (("p50", "-o"), ("p99", "--^")):
            xs, ys = _series(levels, transport, "ttfa_ms", stat)
            if xs:
                ax.plot(xs, ys, style, color=c, label=f"{transport}: TTFA {stat}")
    _x_axis(ax, mode, all_levels)
    ax.set_ylabel("time to first audio (ms)")
    ax.set_title(f"Time to first audio against load (p50 and p99){where}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_ylim(0, 1.15 * max([1.0] + [s["ttfa_ms"][k] or 0 for s in levels for k in ("p50", "p99")]))
    fig.tight_layout()
    written.append(_save(fig, out / "ttfa_vs_concurrency.png", plt))

    # (d) throughput, rejections, errors and underruns against load
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(transports))
    for ti, transport in enumerate(transports):
        c = COLORS[transport]
        rows = [s for s in levels if s["transport"] == transport]
        a1.plot([s["level"] for s in rows], [s["throughput_audio_s_per_s"] or 0 for s in rows], "-o", color=c,
                label=transport)
        bar_x = [all_levels.index(s["level"]) + (ti - (len(transports) - 1) / 2) * width for s in rows]
        for k, (key, hatch) in enumerate((("rejected_429", ""), ("errors", "//"), ("streams_with_underruns", ".."))):
            a2.bar([x + (k - 1) * width / 3 for x in bar_x], [s[key] for s in rows], width / 3, color=c, hatch=hatch,
                   edgecolor="black", lw=0.5, label=f"{transport}: {key.replace('_', ' ')}")
    _x_axis(a1, mode, all_levels)
    a1.set_ylabel("audio seconds generated per wall second")
    a1.set_title("Throughput", fontsize=10)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a1.set_ylim(0, 1.15 * max([1.0] + [s["throughput_audio_s_per_s"] or 0 for s in levels]))
    _level_ticks(a2, mode, range(len(all_levels)), all_levels)
    a2.set_ylabel("streams (count)")
    a2.set_ylim(bottom=0, top=max([1] + [s[k] for s in levels for k in ("rejected_429", "errors",
                                                                          "streams_with_underruns")]) * 1.15)
    a2.yaxis.get_major_locator().set_params(integer=True)
    a2.set_title("429s, errors and streams with underruns", fontsize=10)
    a2.legend(fontsize=7)
    a2.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Throughput and failures against load{where}", fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, out / "throughput_errors.png", plt))
    return written


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.plots DIR``: draw the figures again from ``DIR/report.json``."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m loadtest.plots DIR  (DIR holds report.json)", file=sys.stderr)
        return 2
    out = Path(args[0])
    report = json.loads((out / "report.json").read_text())
    print("wrote", ", ".join(make_plots(report, out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

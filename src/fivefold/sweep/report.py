"""`fivefold report RESULTS --out DIR`: what the playbook draws from its sweeps, from a sweep's results store.

Into DIR: PNG plots (matplotlib, the `report` extra) and `index.html`, one page without external resources
that shows and links the plots and tabulates the runs, and `summary.json` with the same figures:

* `status.png`: runs by status (drawn even when every run failed);
* `mfu_heatmap.png`: the best layout per (model, device count), coloured by its MFU;
* `throughput_<axis>.png`: tokens/s per device against dp, tp, pp, cp, micro-batch size, ZeRO stage and
  recompute, for each axis that takes at least two values among the finished runs;
* `memory.png`: peak memory per device of every finished run (largest rank; the span over ranks as a line),
  with the planner's prediction;
* `step_breakdown.png`: forward, backward and optimizer time per step of every finished run;
* `predicted_vs_measured.png`: the planner's step time and peak memory against the measured ones, with the
  median absolute error and the Spearman rank correlation printed on it (and on the page).

Failed runs (oom, crash, timeout, invalid) are listed with their error and the last lines of their output.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fivefold.config import check_writable_dir, shown
from fivefold.errors import CliError
from fivefold.outputs import keep_previous
from fivefold.planner.score import spearman
from fivefold.sweep.store import StoreError, read_rows

AXES = {"dp": "data parallel (dp)", "tp": "tensor parallel (tp)", "pp": "pipeline parallel (pp)",
        "cp": "context parallel (cp)", "micro_batch_size": "micro-batch size (sequences)",
        "zero": "ZeRO stage", "recompute": "activation recompute"}
SHORT = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "micro_batch_size": "micro-batch size", "zero": "ZeRO stage",
         "recompute": "recompute"}
STATUS_COLORS = {"ok": "#2a9d4b", "oom": "#d1495b", "crash": "#8c2f39", "timeout": "#edae49", "invalid": "#7d7d7d",
                 "interrupted": "#5b8cc0"}
MIB = 2**20
# why a run's forward / backward / optimizer times need not add up to its step time (fivefold.tools.bench)
SPLIT_NOTE = ("The forward / backward / optimizer split is timed on up to three extra steps after the timed ones "
              "(their mean), phase by phase with a synchronisation at each phase boundary, not on the steps whose "
              "median is the step time: the synchronisations expose launch and communication time that a plain "
              "step overlaps, so the three parts need not add up to the step time; compare their shares, not their "
              "sum.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results store written by `fivefold sweep`")
    p.add_argument("--out", required=True, help="folder for the PNG files and index.html (created)")


# ---------------------------------------------------------------------------------------------
# Figures of merit


def accuracy(ok: list[dict]) -> dict[str, Any]:
    """Median absolute relative error and Spearman correlation of predicted vs measured step time and memory."""
    out: dict[str, Any] = {}
    for name, predicted, measured in (("step_time", "predicted_step_time_s", "step_time_s"),
                                      ("memory", "predicted_peak_memory_bytes", "peak_memory_bytes")):
        pairs = [(r[predicted], r[measured]) for r in ok if r.get(predicted) is not None and r.get(measured)]
        errors = [abs(p / m - 1) for p, m in pairs if m > 0]
        out[name] = {
            "runs": len(pairs),
            "median_abs_error": statistics.median(errors) if errors else None,
            "spearman": spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) >= 3 else None,
        }
    return out


def best_per_group(ok: list[dict]) -> dict[tuple[str, int], dict]:
    """The run with the most tokens/s per device for each (model, device count)."""
    best: dict[tuple[str, int], dict] = {}
    for r in ok:
        g = (r["model"], r["n_devices"])
        if g not in best or r["tokens_per_s_per_device"] > best[g]["tokens_per_s_per_device"]:
            best[g] = r
    return dict(sorted(best.items()))


def layout_of_label(label: str) -> str:
    return label.split(" | ", 1)[-1]


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"


def _num(x: float | None, fmt: str = "{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x)


# ---------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise CliError("fivefold report needs matplotlib: pip install 'fivefold[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "figure.dpi": 110,
                         "axes.grid": True, "grid.alpha": 0.3})
    return plt


def plot_status(plt, rows: list[dict], path: Path) -> None:
    counts = Counter(r["status"] for r in rows)
    names = [s for s in STATUS_COLORS if counts[s]]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    bars = ax.bar(names, [counts[s] for s in names], color=[STATUS_COLORS[s] for s in names])
    ax.bar_label(bars, padding=2)
    ax.set_xlabel("status")
    ax.set_ylabel("runs")
    ax.set_title(f"{len(rows)} runs by status")
    ax.set_ylim(0, max(counts.values(), default=1) * 1.2)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", visible=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_mfu_heatmap(plt, best: dict[tuple[str, int], dict], path: Path) -> None:
    models = sorted({m for m, _ in best})
    devices = sorted({n for _, n in best})
    import numpy as np

    grid = np.full((len(models), len(devices)), np.nan)
    for (m, n), r in best.items():
        if r.get("mfu") is not None:
            grid[models.index(m), devices.index(n)] = 100 * r["mfu"]
    fig, ax = plt.subplots(figsize=(max(5.5, 2.9 * len(devices) + 2.5), max(2.6, 1.1 * len(models) + 1.6)))
    masked = np.ma.masked_invalid(grid)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
    im = ax.imshow(masked, cmap=cmap, vmin=0, vmax=top * 1.05 or 1.0, aspect="auto")
    ax.set_xticks(range(len(devices)), [str(n) for n in devices])
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel("devices")
    ax.set_ylabel("model")
    ax.grid(False)
    for (m, n), r in best.items():
        i, j = models.index(m), devices.index(n)
        value = grid[i, j]
        text = (f"{value:.1f} %\n" if math.isfinite(value) else "") + _wrap(layout_of_label(r["label"]))
        dark = math.isfinite(value) and value < 0.6 * top
        ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="MFU (%)")
    ax.set_title("Best layout per model and device count (colour: its MFU)")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _wrap(layout: str) -> str:
    words = layout.split()
    half = (len(words) + 1) // 2
    return " ".join(words[:half]) + "\n" + " ".join(words[half:])


def _series(ok: list[dict]) -> dict[tuple[str, int], list[dict]]:
    out: dict[tuple[str, int], list[dict]] = {}
    for r in ok:
        out.setdefault((r["model"], r["n_devices"]), []).append(r)
    return dict(sorted(out.items()))


def _axis_values(ok: list[dict], axis: str) -> list:
    values = {r[axis] for r in ok if r.get(axis) is not None}
    if axis == "recompute":
        return [v for v in ("none", "selective", "full") if v in values]
    return sorted(values)


def plot_axis(plt, ok: list[dict], axis: str, path: Path) -> None:
    values = _axis_values(ok, axis)
    series = _series(ok)
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    width = 0.3
    for k, ((model, n), all_runs) in enumerate(series.items()):
        runs = [r for r in all_runs if r.get(axis) in values]
        offset = (k - (len(series) - 1) / 2) * width / max(len(series), 1)
        xs = [values.index(r[axis]) + offset for r in runs]
        ys = [r["tokens_per_s_per_device"] for r in runs]
        points = ax.scatter(xs, ys, s=28, alpha=0.75, label=f"{model}, {n} device{'s' * (n > 1)}")
        best = {}
        for r in runs:
            best[r[axis]] = max(best.get(r[axis], 0.0), r["tokens_per_s_per_device"])
        order = [v for v in values if v in best]
        ax.plot([values.index(v) + offset for v in order], [best[v] for v in order], color=points.get_facecolor()[0],
                alpha=0.9, linewidth=1.2)
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel("tokens/s per device")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Tokens/s per device against {SHORT[axis]} (line: the best run at each value)")
    ax.yaxis.set_major_formatter(_thousands())
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _thousands():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


def _sorted_ok(ok: list[dict]) -> list[dict]:
    return sorted(ok, key=lambda r: (r["model"], r["n_devices"], -r["tokens_per_s_per_device"]))


def _unit(values: list[float]) -> tuple[float, str]:
    return (2**30, "GiB") if max(values, default=0) >= 4 * 2**30 else (MIB, "MiB")


def plot_memory(plt, ok: list[dict], path: Path) -> None:
    runs = _sorted_ok(ok)[::-1]
    scale, unit = _unit([r["peak_memory_bytes"] for r in runs])
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.32 * len(runs)))
    ys = range(len(runs))
    ax.barh(ys, [r["peak_memory_bytes"] / scale for r in runs], color="#4c78a8", label="measured (largest rank)")
    for y, r in zip(ys, runs, strict=True):
        ranks = r.get("peak_memory_per_rank") or []
        if len(ranks) > 1:
            ax.plot([min(ranks) / scale, max(ranks) / scale], [y + 0.3, y + 0.3], color="black", linewidth=1.5)
        ax.text(r["peak_memory_bytes"] / scale, y, f"{r['peak_memory_bytes'] / scale:,.0f} ", va="center",
                ha="right", fontsize=8, color="white")
    pred = [(y, r["predicted_peak_memory_bytes"] / scale) for y, r in zip(ys, runs, strict=True)
            if r.get("predicted_peak_memory_bytes") is not None]
    if pred:
        ax.scatter([p for _, p in pred], [y for y, _ in pred], marker="D", color="#f58518", zorder=3, s=22,
                   label="planner's prediction")
    _finish_runs_chart(plt, fig, ax, runs, f"peak memory per device ({unit})",
                       "Peak memory per device (line: span over ranks)", path)


def _finish_runs_chart(plt, fig, ax, runs: list[dict], xlabel: str, title: str, path: Path) -> None:
    """Labels, legend and file of a horizontal bar chart with one bar per run."""
    ax.set_yticks(list(range(len(runs))), [f"{r['label']} ({r['n_devices']} dev)" for r in runs], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_breakdown(plt, ok: list[dict], path: Path) -> None:
    runs = [r for r in _sorted_ok(ok) if r.get("forward_s") is not None][::-1]
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.32 * len(runs)))
    ys = list(range(len(runs)))
    left = [0.0] * len(runs)
    for part, color in (("forward_s", "#4c78a8"), ("backward_s", "#f58518"), ("optimizer_s", "#54a24b")):
        widths = [1e3 * r[part] for r in runs]
        ax.barh(ys, widths, left=left, color=color, label=part[:-2])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    _finish_runs_chart(plt, fig, ax, runs, "time per step (ms)", "Step time by phase", path)


def plot_predicted(plt, ok: list[dict], acc: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    panels = (("step_time", "predicted_step_time_s", "step_time_s", 1.0, "step time (s)"),
              ("memory", "predicted_peak_memory_bytes", "peak_memory_bytes", MIB, "peak memory per device (MiB)"))
    devices = sorted({r["n_devices"] for r in ok})
    for ax, (name, predicted, measured, scale, what) in zip(axes, panels, strict=True):
        pairs = [(r[measured] / scale, r[predicted] / scale, r["n_devices"]) for r in ok
                 if r.get(predicted) is not None and r.get(measured)]
        for n in devices:
            xs = [m for m, _, d in pairs if d == n]
            ys = [p for _, p, d in pairs if d == n]
            if xs:
                ax.scatter(xs, ys, s=30, alpha=0.8, label=f"{n} device{'s' * (n > 1)}")
        if pairs:
            lo = min(min(m, p) for m, p, _ in pairs) / 1.5
            hi = max(max(m, p) for m, p, _ in pairs) * 1.5
            ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="predicted = measured")
            ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="gray", alpha=0.15,
                            label="within 25 %")
            _log_axes(ax, lo, hi)
            ax.legend(fontsize=9, loc="upper left")
        a = acc[name]
        rho = "n/a" if a["spearman"] is None else f"{a['spearman']:.2f}"
        ax.set_title(f"{what.split(' (')[0].capitalize()}\nmedian |error| {_pct(a['median_abs_error'])}, "
                     f"Spearman {rho} (n = {a['runs']})", fontsize=11)
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"predicted {what}")
    fig.suptitle("Planner's prediction against the measurement")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _log_axes(ax, lo: float, hi: float) -> None:
    """Log scales on both axes, ticks at 1-2-5 steps written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")


# ---------------------------------------------------------------------------------------------
# The page


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; vertical-align: top; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f7f7f7; padding: 0.5em; font-size: 0.8em; overflow-x: auto; max-width: 1100px; margin: 0; }
.ok { color: #2a9d4b; } .bad { color: #b00020; font-weight: bold; }
"""


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    th = "".join(f'<th class="l">{h}</th>' if i < left else f"<th>{h}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _mem(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MIB:,.0f}"


def write_page(out: Path, source: str, rows: list[dict], figures: list[tuple[str, str]], acc: dict,
               notes: list[str]) -> Path:
    def e(value: object) -> str:  # every value from the store reaches the page escaped, whatever its type
        return html.escape(str(value))

    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    counts = Counter(r["status"] for r in rows)
    sweeps = sorted({r["sweep"] for r in rows if r.get("sweep")})
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fivefold sweep report: "
             f"{e(', '.join(sweeps))}</title><style>{CSS}</style></head><body>",
             f"<h1>fivefold sweep report: {e(', '.join(sweeps) or source)}</h1>",
             f"<p>{len(rows)} runs from <code>{e(source)}</code>: "
             + ", ".join(f"<span class='{'ok' if s == 'ok' else 'bad'}'>{n} {e(s)}</span>" for s, n in counts.items())
             + f". Written {time.strftime('%Y-%m-%d %H:%M')}.</p>"]
    if not ok:
        parts.append("<p class='bad'>No run finished, so there is nothing to plot but the statuses; why each run "
                     "failed is listed under <a href='#failures'>Failed runs</a>.</p>")
    else:
        t, m = acc["step_time"], acc["memory"]
        parts.append("<h2>Planner's accuracy</h2><p>")
        parts.append(f"Step time: median absolute error <b>{_pct(t['median_abs_error'])}</b>, Spearman rank "
                     f"correlation <b>{_num(t['spearman'], '{:.3f}')}</b> over {t['runs']} runs. Peak memory: "
                     f"median absolute error <b>{_pct(m['median_abs_error'])}</b>, Spearman "
                     f"<b>{_num(m['spearman'], '{:.3f}')}</b>.</p>")
        best = best_per_group(ok)
        parts.append("<h2>Best layout per model and device count</h2>")
        parts.append(_table(["model", "devices", "layout", "tokens/s per device", "MFU", "step time (s)",
                             "peak memory (MiB)"],
                            [[e(g[0]), e(g[1]), e(layout_of_label(r["label"])),
                              f"{r['tokens_per_s_per_device']:,.0f}", _pct(r.get("mfu")), f"{r['step_time_s']:.4f}",
                              _mem(r["peak_memory_bytes"])] for g, r in best.items()], left=3))
    parts.append("<h2>Plots</h2>")
    for name, caption in figures:
        parts.append(f"<figure><a href='{e(name)}'><img src='{e(name)}' alt='{e(caption)}'></a>"
                     f"<figcaption>{e(caption)} (<a href='{e(name)}'>{e(name)}</a>)</figcaption></figure>")
    for note in notes:
        parts.append(f"<p><i>{e(note)}</i></p>")
    if ok:
        parts.append("<h2>Finished runs</h2>")
        head = ["run", "key", "devices", "step time (s)", "predicted (s)", "error", "tokens/s per device", "MFU",
                "forward / backward / optimizer (ms)*", "peak memory per rank (MiB)", "predicted (MiB)"]
        body = []
        for r in _sorted_ok(ok):
            pred = r.get("predicted_step_time_s")
            split = "n/a"
            if r.get("forward_s") is not None:
                phases = [r[k] for k in ("forward_s", "backward_s", "optimizer_s")]
                split = (" / ".join(f"{1e3 * x:.1f}" for x in phases) +
                         f" (sum {100 * sum(phases) / r['step_time_s']:.0f} % of the step)")
            ranks = ", ".join(_mem(x) for x in (r.get("peak_memory_per_rank") or []))
            body.append([e(r["label"]), f"<code>{e(r['key'])}</code>", e(r["n_devices"]), f"{r['step_time_s']:.4f}",
                         _num(pred, "{:.4f}"), _pct(pred / r["step_time_s"] - 1) if pred else "n/a",
                         f"{r['tokens_per_s_per_device']:,.0f}", _pct(r.get("mfu")), split, ranks,
                         _mem(r.get("predicted_peak_memory_bytes"))])
        parts.append(_table(head, body, left=2))
        parts.append(f"<p><i>* {e(SPLIT_NOTE)}</i></p>")
    parts.append("<h2 id='failures'>Failed runs</h2>")
    if not failed:
        parts.append("<p>None.</p>")
    else:
        body = []
        for r in sorted(failed, key=lambda r: (r["status"], r.get("label") or "")):
            tail = f"<pre>{e(r['error_tail'])}</pre>" if r.get("error_tail") else ""
            body.append([e(r["label"]), f"<span class='bad'>{e(r['status'])}</span>", e(r["n_devices"]),
                         f"{e(r.get('error') or '')}{tail}"])
        parts.append(_table(["run", "status", "devices", "why (the error, then the last lines of the output)"], body,
                            left=4))
    parts.append("</body></html>\n")
    path = out / "index.html"
    path.write_text("\n".join(parts))
    return path


def make_report(results: str | Path, out: str | Path) -> dict:
    """Write the plots, index.html and summary.json into `out`; returns the summary."""
    try:
        rows = read_rows(results)
    except StoreError as e:
        raise CliError(str(e)) from None
    if not rows:
        raise CliError(f"{results} holds no runs yet; run `fivefold sweep GRID.toml --results {results}` first")
    plt = _pyplot()  # the optional extra before anything is written
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {shown(str(out))} is a file, not a folder; give a folder for the report")
    # a folder that holds an earlier report of ours is rewritten, and that report's plots that this one does not
    # draw are moved aside; in any other folder, a file of the names written here is moved aside. Moved aside:
    # kept as NAME.bak (NAME.bak2, ...), one line said for each, so nothing is lost
    earlier = _earlier_report(out) if out.is_dir() else None
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if r["status"] == "ok"]
    figures: list[tuple[str, str]] = []
    notes: list[str] = []

    def set_aside(path: Path, whose: str) -> None:
        backup = keep_previous(path)
        if backup is not None:
            print(f"fivefold report: moved {whose} {path} aside to {backup.name}")

    def target(name: str) -> Path:
        if earlier is None:
            set_aside(out / name, "the existing file")
        return out / name

    def add(name: str, caption: str, draw, *args) -> None:
        draw(plt, *args, target(name))
        figures.append((name, caption))

    add("status.png", "Runs by status", plot_status, rows)
    acc = accuracy(ok)
    if ok:
        add("mfu_heatmap.png", "Best layout per model and device count, coloured by its MFU", plot_mfu_heatmap,
            best_per_group(ok))
        for axis, what in AXES.items():
            values = _axis_values(ok, axis)
            if len(values) >= 2:
                add(f"throughput_{axis}.png", f"Tokens/s per device against {what}", plot_axis, ok, axis)
            elif values:
                notes.append(f"No throughput plot against {what}: every finished run has {axis} = {values[0]}.")
        add("memory.png", "Peak memory per device, measured and predicted", plot_memory, ok)
        if any(r.get("forward_s") is not None for r in ok):
            add("step_breakdown.png", "Step time by phase (forward, backward, optimizer; timed on separate steps, "
                "phase by phase, so the bars need not add up to the step time)", plot_breakdown, ok)
        add("predicted_vs_measured.png", "The planner's step time and peak memory against the measured ones",
            plot_predicted, ok, acc)
        sources = sorted({r["memory_source"] for r in ok if r.get("memory_source")})
        notes += [f"Measured memory: {s}." for s in sources]
        profiles = sorted({r["hardware"] for r in ok if r.get("hardware")})
        if profiles:
            notes.append(f"Predictions from the planner with the hardware profile(s): {', '.join(profiles)}.")
    target("index.html")
    page = write_page(out, str(results), rows, figures, acc, notes)
    summary = {"runs": len(rows), "statuses": dict(Counter(r["status"] for r in rows)), "accuracy": acc,
               "figures": [name for name, _ in figures], "page": page.name,
               "best": [{"model": g[0], "devices": g[1], "layout": layout_of_label(r["label"]), "key": r["key"],
                         "tokens_per_s_per_device": r["tokens_per_s_per_device"], "mfu": r.get("mfu")}
                        for g, r in best_per_group(ok).items()],
               "failed": [{"key": r["key"], "label": r["label"], "status": r["status"], "error": r.get("error")}
                          for r in rows if r["status"] != "ok"]}
    target("summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name in sorted((earlier or set()) - set(summary["figures"])):
        set_aside(out / name, "the earlier report's plot")
    return summary


def _earlier_report(folder: Path) -> set[str] | None:
    """The plots of the report that `make_report` wrote into `folder` (its summary.json names the page, the runs
    and the plots): those of them that are files there, by name; None when the folder holds no such report."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(summary, dict) or not {"runs", "page", "figures"} <= set(summary):
        return None
    figures = summary["figures"] if isinstance(summary["figures"], list) else []
    # plain names of PNG files only: a summary.json edited to name other files moves nothing else aside
    return {name for name in figures if isinstance(name, str) and name.endswith(".png") and Path(name).name == name
            and (folder / name).is_file()}


def run(args: argparse.Namespace) -> int:
    check_writable_dir(args.out, "--out")  # before reading the store: a folder that can be made and written
    summary = make_report(args.results, args.out)
    acc = summary["accuracy"]["step_time"]
    statuses = ", ".join(f"{n} {s}" for s, n in summary["statuses"].items())
    print(f"fivefold report: {summary['runs']} runs ({statuses}); {len(summary['figures'])} plots and "
          f"{Path(args.out) / summary['page']}")
    if acc["runs"]:
        rho = "n/a" if acc["spearman"] is None else f"{acc['spearman']:.3f}"
        print(f"  planner's step time: median |error| {_pct(acc['median_abs_error'])}, Spearman {rho} "
              f"over {acc['runs']} runs")
    return 0

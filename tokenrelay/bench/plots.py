"""The benches' `--plot` charts: one PNG per bench, drawn with matplotlib (the `bench` extra) off-screen.

`--plot` takes a file ending in .png, or a directory, which gets `<bench>.png`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

_OUTCOME_COLOURS = {
    "completed": "tab:green",
    "lost": "tab:red",
    "duplicated": "tab:orange",
    "missing": "tab:purple",
    "different": "tab:brown",
    "hung": "tab:gray",
}


def target(plot: str, bench: str) -> Path:
    """Where `--plot PLOT` puts the chart of `bench`: PLOT itself if it ends in .png, else PLOT/<bench>.png."""
    path = Path(plot)
    if path.suffix.lower() == ".png":
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{bench}.png"


def _subplots(columns: int, width: float = 5.5):
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, columns, figsize=(width * columns, 4))
    return figure, list(axes) if columns > 1 else [axes]


def _save(figure, path: Path) -> Path:
    from matplotlib import pyplot

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def _bars(axis, names: list[str], values: list[float], colours: Iterable[str] | None = None, fmt: str = "{:.0f}"):
    bars = axis.bar(names, values, color=list(colours) if colours else None)
    axis.bar_label(bars, labels=[fmt.format(v) for v in values], padding=2, fontsize=8)
    axis.tick_params(axis="x", labelrotation=15)
    return bars


def _grouped(axis, names: list[str], series: dict[str, list[float]]) -> None:
    """Bars of several series (e.g. p50/p99) side by side for each name."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(names))]
        bars = axis.bar(positions, values, width, label=label)
        axis.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=2, fontsize=7)
    axis.set_xticks(range(len(names)), names, rotation=15)
    axis.legend()


def scale(rows: list[dict], path: Path) -> Path:
    """`bench scale`: token throughput (measured and ideal) and TTFT against the worker count."""
    figure, (throughput, ttft) = _subplots(2)
    counts = [r["workers"] for r in rows]
    throughput.plot(counts, [r["token_throughput"] for r in rows], "o-", label="measured")
    throughput.plot(counts, [n * rows[0]["token_throughput"] / rows[0]["workers"] for n in counts], "--", label="ideal")
    throughput.set(xlabel="simulated workers", ylabel="tokens/s", title="Token throughput")
    throughput.legend()
    for q in ("p50", "p99"):
        ttft.plot(counts, [r["ttft_ms"][q] for r in rows], "o-", label=f"TTFT {q}")
    ttft.set(xlabel="simulated workers", ylabel="ms", title="Time to first token")
    ttft.legend()
    return _save(figure, path)


def engine(report: dict, path: Path) -> Path:
    """`bench engine`: output tokens/s of the engine (on each model implementation) and of each baseline, and their
    TTFT p50/p99."""
    engines = {f"engine\n{impl}": result for impl, result in report["engines"].items()}
    results = {**engines, **report["baselines"]}
    names = []
    for name, result in results.items():
        label = name if name in engines else "transformers\n" + name.removeprefix("transformers_").replace("_", " ")
        if result["requests"] != report["engine"]["requests"]:  # a baseline that runs only the first ones
            label += f"\n(first {result['requests']})"
        names.append(label + ("\nTIMED OUT" if result["timed_out"] else ""))
    figure, (throughput, ttft) = _subplots(2, width=6)
    colours = ["tab:blue" if name in engines else "tab:gray" for name in results]
    _bars(throughput, names, [r["tokens_per_s"] for r in results.values()], colours, "{:.1f}")
    workload = report["workload"]
    throughput.set(
        ylabel="output tokens/s",
        title=f"{workload['requests']} requests, {workload['device']} {workload['dtype'].removeprefix('torch.')}",
    )
    _grouped(
        ttft,
        names,
        {q: [r[f"ttft_{q}_ms"] for r in results.values()] for q in ("p50", "p99")},
    )
    ttft.set(ylabel="ms from the run's start", title="Time to first token")
    ttft.set_yscale("log")
    return _save(figure, path)


def serve(results: dict[str, dict], path: Path) -> Path:
    """`bench serve`: output tokens/s, TTFT and inter-token latency of each topology (or of the server)."""
    names = list(results)
    figure, (throughput, ttft, itl) = _subplots(3, width=4.5)
    _bars(throughput, names, [r["output_token_throughput"] for r in results.values()], fmt="{:.1f}")
    throughput.set(ylabel="output tokens/s", title="Token throughput")
    for axis, metric, title in ((ttft, "ttft_ms", "Time to first token"), (itl, "itl_ms", "Inter-token latency")):
        _grouped(axis, names, {q: [r[metric][q] for r in results.values()] for q in ("p50", "p90", "p99")})
        axis.set(ylabel="ms", title=title)
    return _save(figure, path)


def chaos(
    result: dict, ended: list[tuple[float, str]], kills: list[float], delays: list[float], duration_s: float, path: Path
) -> Path:
    """`bench chaos`: streams ended per second by outcome with the kills marked, the outcome counts, and how
    long each stream a kill broke took to resume. `ended`: (seconds from the start, outcome) per stream,
    `kills`: seconds from the start."""
    figure, (timeline, outcomes, resumed) = _subplots(3, width=4.8)
    seconds = int(max(duration_s, *(t for t, _ in ended), 0)) + 1
    bottom = [0] * seconds
    for outcome, colour in _OUTCOME_COLOURS.items():
        per_second = [0] * seconds
        for at, what in ended:
            if what == outcome:
                per_second[min(seconds - 1, max(0, int(at)))] += 1
        if any(per_second):
            timeline.bar(range(seconds), per_second, 1.0, bottom=bottom, color=colour, label=outcome, align="edge")
            bottom = [b + n for b, n in zip(bottom, per_second, strict=True)]
    for i, at in enumerate(kills):
        timeline.axvline(at, color="black", linestyle="--", linewidth=1, label="worker killed" if i == 0 else None)
    timeline.set(xlabel="seconds", ylabel="streams ended", title="Streams ended per second")
    timeline.legend(fontsize=8)
    names = list(_OUTCOME_COLOURS)
    _bars(outcomes, names, [result[o] for o in names], _OUTCOME_COLOURS.values())
    outcomes.set(ylabel="streams", title=f"{result['requests']} streams, {result['workers_killed']} workers killed")
    resumed.plot(range(1, len(delays) + 1), sorted(delays), "o", color="tab:blue")
    resumed.set(xlabel="broken stream (sorted)", ylabel="seconds", title="Kill to the stream's next token")
    return _save(figure, path)

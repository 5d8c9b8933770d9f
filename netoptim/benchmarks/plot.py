"""``netoptim bench MODE --plot FILE.png``: a chart of the benchmark's comparison, drawn from the JSON
result it prints (which stays as it is on stdout). matplotlib is an optional extra: ``pip install
'netoptim-train[plot]'``.

Each mode names the figures it compares (:data:`METRICS`): every number in the result under such a
key is a bar, labelled by where it sits (``ddp``, ``results.netoptim``) or by the configuration beside
it (``1024 buckets``); the title carries the ratio. ``bench morph`` draws each morph's pause against a
median step; ``bench convergence`` draws the loss curves of its moment formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS: dict[str, tuple[str, str]] = {
    # mode: (regular expression a compared figure's key matches, its unit)
    "optimizer": (r".*_mparams_per_s$", "Mparam/s"),
    "transport": (r".*_gbs$", "GB/s"),
    "offload": (r".*_mparams_per_s$", "Mparam/s"),
    "train": (r"^tokens_per_s$", "tokens/s"),
    "gpu": (r"^tokens_per_s$", "tokens/s"),
    "cluster": (r"^tokens_per_s$", "tokens/s"),
    "plan": (r"^(measured|predicted)_step_s$", "s per step"),
    "cost": (r"^(measured|predicted)_step_s$", "s per step"),
    "step": (r"^step_s$", "s per step"),
    "convergence": (r"^median_final_loss$", "loss"),
}
_LABEL_KEYS = ("buckets", "configuration", "workers")  # what tells the bars of one list apart


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_available() -> None:
    """:class:`PlotUnavailable` with the install hint, before a benchmark runs for nothing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot draws with matplotlib, which is not installed: pip install 'netoptim-train[plot]'") from None


def _numbers(value: Any, path: tuple[str, ...] = (), label: str = "") -> Iterator[tuple[str, str, float]]:
    """(label, key, number) of every number in ``value``; a list item is labelled by its configuration."""
    if isinstance(value, dict):
        mark = next((f"{value[k]} {k}" for k in _LABEL_KEYS if isinstance(value.get(k), (int, float, str)) and not isinstance(value.get(k), bool)), "")
        here = mark or label  # the innermost configuration names the bar
        for key, item in value.items():
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                yield (here or ".".join(path) or "result"), key, float(item)
            else:
                yield from _numbers(item, (*path, key), here)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, (*path, str(index)), label)


def bars_of(mode: str, result: dict) -> tuple[list[str], list[float], str]:
    """The labels, values and unit of the bars ``mode``'s chart draws."""
    if mode == "morph":
        pauses = result.get("morph_pauses_s", {})
        labels = ["median step", *(f"morph at step {step}" for step in pauses)]
        return labels, [float(result["median_step_s"]), *map(float, pauses.values())], "seconds"
    pattern, unit = METRICS.get(mode, (r"^ratio$", ""))
    picked = [(f"{label}: {key}" if label else key, number) for label, key, number in _numbers(result) if re.match(pattern, key)]
    if not picked:
        raise ValueError(f"the {mode} result has no figure to draw (keys matching {pattern})")
    return [label for label, _ in picked], [number for _, number in picked], unit


def _plot_curves(result: dict, path: Path) -> Path:
    """``bench convergence``: each moment format's loss curve (the median over seeds), its ratio in the legend."""
    from matplotlib import pyplot

    curves, every = result.get("curves", {}), int(result.get("curve_every", 1))
    if not curves:
        raise ValueError("the convergence result has no loss curve to draw")
    figure, axes = pyplot.subplots(figsize=(7.0, 4.0))
    for moments, losses in curves.items():
        ratio = result.get("settings", {}).get(moments, {}).get("ratio")
        label = f"{moments} moments" + (f" (final loss x{float(ratio):.4f} of fp32)" if moments != "fp32" and isinstance(ratio, (int, float)) else "")
        axes.plot([min((i + 1) * every, result.get("steps", (i + 1) * every)) for i in range(len(losses))], losses, label=label, linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel(f"training loss (mean of {every} steps, median of {len(result.get('seeds', [])) or 1} seed(s))")
    axes.legend(fontsize=8)
    ratio = result.get("ratio")
    axes.set_title("netoptim bench convergence" + (f": ratio {float(ratio):.4g}" if isinstance(ratio, (int, float)) else ""), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def plot_result(mode: str, result: dict, path: str | Path) -> Path:
    """Draw ``mode``'s comparison from its ``result`` into ``path`` (PNG); returns the path."""
    check_available()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot

    if mode == "convergence":
        return _plot_curves(result, Path(path))
    labels, values, unit = bars_of(mode, result)
    figure, axes = pyplot.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.0))
    bars = axes.barh(range(len(labels)), values, color=["#3a6ea5" if "netoptim" in label or "node" in label else "#9a9a9a" for label in labels])
    axes.set_yticks(range(len(labels)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
    axes.set_xlabel(unit)
    ratio = result.get("ratio")
    axes.set_title(f"netoptim bench {mode}" + (f": ratio {float(ratio):.3g}" if isinstance(ratio, (int, float)) else ""), fontsize=10)
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target, dpi=110)
    pyplot.close(figure)
    return target

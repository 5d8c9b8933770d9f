"""``bench gpu``'s report as a table for people (the JSON on stdout stays the record)."""

from __future__ import annotations

OURS = ("full", "layerwise")


def _ratio(entry: dict, mode: str, baseline: str) -> str:
    value = entry.get(f"{mode}_over_{baseline}_tokens")
    return f"{value:.2f}x" if value is not None else "-"


def _node(result: dict) -> str:
    """The first node's last step: the time in its passes (median bucket) and after the last gradient;
    layer-wise, also the parameters fetched a step."""
    fetched = f"; fetched {result['fetched_mb_per_step'] / 1024:.1f} GiB a step" if "fetched_mb_per_step" in result else ""
    return _passes(result) + fetched


def _passes(result: dict) -> str:
    nodes = result.get("nodes") or []
    if not nodes:
        return "-"
    passes, phases = nodes[0].get("last_step_passes") or {}, nodes[0].get("last_step_s") or {}
    if "seconds" not in passes:
        return "-"
    tail = f", tail {phases['tail']:.2f} s" if "tail" in phases else ""
    return f"passes {passes['seconds']:.2f} s ({passes.get('median_ms', 0.0):.2f} ms a bucket){tail}"


def _settings(settings: dict) -> str:
    """What a run of netoptim's modes was set to, so that runs compared on one box say how they differ."""
    parts = [f"buckets of {settings['bucket_numel']:,} elements"] if "bucket_numel" in settings else []
    if "overlap_forward" in settings:
        parts.append(f"overlap_forward {'on' if settings['overlap_forward'] else 'off'}")
    if settings.get("keep_step_gradients") is False:  # the default says nothing
        parts.append("step gradients let go once pushed")
    if settings.get("keep_for_backward"):
        parts.append(f"layer-wise keeps {settings['keep_for_backward'] / 2**30:.1f} GiB of parameters for backward")
    if settings.get("node_threads"):
        parts.append(f"{settings['nodes']} node(s) of {settings['node_threads']} update threads")
    if settings.get("node_args"):
        parts.append("node flags " + " ".join(settings["node_args"]))
    return "netoptim: " + ", ".join(parts) if parts else ""


def table(report: dict) -> str:
    """A line with netoptim's settings, then one line per mode run: tokens/s, step, peak GPU memory,
    netoptim's ratio to ZeRO-2 and ZeRO-3 of the same size and dtype, the fraction of the offload
    limit, and the node's last step."""
    settings = _settings(report.get("settings") or {})
    lines = [settings] if settings else []
    lines += [f"{'size':<6} {'dtype':<9} {'mode':<10} {'tokens/s':>9} {'step s':>7} {'GPU GiB':>8} {'/ZeRO-2':>8} {'/ZeRO-3':>8} {'of limit':>8}  node"]
    for size, per_dtype in report.get("sizes", {}).items():
        for dtype_name, entry in per_dtype.items():
            if not isinstance(entry, dict):
                continue
            for mode, result in entry.items():
                if not isinstance(result, dict) or mode.endswith("_limit"):
                    continue
                if "tokens_per_s" not in result:
                    lines.append(f"{size:<6} {dtype_name:<9} {mode:<10} {result.get('status', result.get('error', 'no figure'))}")
                    continue
                ours = mode in OURS
                fraction = entry.get(f"{mode}_fraction_of_offload_limit")
                lines.append(
                    f"{size:<6} {dtype_name:<9} {mode:<10} {result['tokens_per_s']:>9,.0f} {result['step_s']:>7.3f} "
                    f"{result.get('peak_gpu_mb', 0.0) / 1024:>8.1f} {_ratio(entry, mode, 'zero2') if ours else '':>8} "
                    f"{_ratio(entry, mode, 'zero3') if ours else '':>8} {f'{fraction:.2f}' if fraction is not None else '-':>8}  "
                    f"{_node(result) if ours else ''}"
                )
    return "\n".join(line.rstrip() for line in lines)

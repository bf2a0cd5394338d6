"""Pareto plots in the style of DeepInfer's charts: prefill tokens/s/GPU against step latency,
decode tokens/s/GPU against tokens/s/user; our points, the baseline's and the roofline.

matplotlib is optional (root ``bench`` dependency group): without it, no PNG is written and
``write_plots`` says so and returns an empty list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SERIES = {"ours": ("DeepInfer", "o-", "tab:blue"), "baseline": ("transformers", "s-", "tab:orange")}


def matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (uv sync --group bench): no PNG plots written"
    return None


def _plot(ax, result: dict[str, Any], phase: str, x_key: str, y_key: str) -> None:
    roof = result["roofline"][phase]
    ax.plot([p[x_key] for p in roof], [p[y_key] for p in roof], "--", color="gray",
            label="roofline (counted FLOPs and bytes / measured rates)")  # fmt: skip
    for name, (label, style, color) in SERIES.items():
        points = result.get(name, {}).get(phase, [])  # a skipped baseline has none
        if points:
            ax.plot([p[x_key] for p in points], [p[y_key] for p in points], style,
                    color=color, label=label)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def write_plots(result: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Write ``<stem>-prefill.png`` and ``<stem>-decode.png``; return the paths written."""
    if matplotlib_missing():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = result["settings"]["device"] == "cuda"
    device = result["env"]["gpu"] if on_gpu else "CPU"
    title = f"{result['model']['label']}\n{device}, commit {result['env']['commit']}"
    specs = [
        ("prefill", "step_ms", "tok/s/gpu", "step latency (ms)", "prefill tokens/s/GPU"),
        ("decode", "tok/s/user", "tok/s/gpu", "tokens/s/user", "output tokens/s/GPU"),
    ]
    paths = []
    for phase, x_key, y_key, x_label, y_label in specs:
        fig, ax = plt.subplots(figsize=(5.5, 4), dpi=80)
        _plot(ax, result, phase, x_key, y_key)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.set_title(title, fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}-{phase}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths

"""The records of GPT runs: each run's log.csv and curves.png, and the comparison of all recipes
(gpt.md, a table; gpt.png, every recipe's validation loss against the step)."""

from __future__ import annotations

import csv
import pathlib

from experiments.runs import write_atomically, write_csv

__all__ = [
    "COLUMNS",
    "write_log",
    "read_log",
    "plot_run",
    "tokens_per_second",
    "comparison_table",
    "plot_comparison",
]

# One row per evaluation. train_loss is the mean training loss (nats per character) of the steps
# since the previous row (empty at step 0); validation_loss the mean cross-entropy over the
# validation windows; tokens the training tokens seen so far (all processes); train_seconds the
# time spent on those steps (forward, backward, optimizer), eval_seconds on this evaluation.
COLUMNS = (
    "step",
    "lr",
    "train_loss",
    "validation_loss",
    "tokens",
    "train_seconds",
    "eval_seconds",
)


def write_log(path: pathlib.Path, history: list[dict]) -> None:
    """A run's log.csv: one row of COLUMNS per evaluation, written atomically."""
    write_csv(path, history, COLUMNS)


def read_log(path: pathlib.Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _pyplot():
    import matplotlib  # noqa: PLC0415  (imported on first use: training needs no plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_run(path: pathlib.Path, history: list[dict], title: str) -> None:
    """Training and validation loss (nats per character) against the step, as a PNG (matplotlib's
    Agg backend), put in place atomically."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = (
        ("train_loss", "training (mean over the steps since the previous point)", "--"),
        ("validation_loss", "validation", "-"),
    )
    for key, label, style in curves:
        points = [(int(r["step"]), float(r[key])) for r in history if r[key] != ""]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, style, marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def tokens_per_second(history: list[dict]) -> float:
    """Training tokens per second of training time over the whole run."""
    seconds = sum(float(r["train_seconds"]) for r in history)
    tokens = int(history[-1]["tokens"])
    return tokens / seconds if seconds > 0 else float("nan")


def comparison_table(runs: dict[str, list[dict] | None], summaries: dict[str, str]) -> list[str]:
    """Markdown rows: recipe, what it quantises, final validation loss, its gap to fp32 (recipe
    minus fp32), training tokens per second and the simulation overhead (fp32's tokens per second
    over the recipe's). ``runs`` maps recipe names to their histories (None: not run)."""
    reference = runs.get("fp32")
    fp32_loss = float(reference[-1]["validation_loss"]) if reference else None
    fp32_speed = tokens_per_second(reference) if reference else None
    lines = [
        "| recipe | quantises | final validation loss | gap to fp32 | tokens/s | overhead |",
        "|---|---|---|---|---|---|",
    ]
    for name, history in runs.items():
        if history is None:
            lines.append(f"| `{name}` | {summaries[name]} | not run | | | |")
            continue
        loss = float(history[-1]["validation_loss"])
        speed = tokens_per_second(history)
        gap = "" if fp32_loss is None else f"{loss - fp32_loss:+.4f}"
        overhead = "" if fp32_speed is None else f"{fp32_speed / speed:.1f}x"
        lines.append(
            f"| `{name}` | {summaries[name]} | {loss:.4f} | {gap} | {speed:,.0f} | {overhead} |"
        )
    return lines


def plot_comparison(path: pathlib.Path, runs: dict[str, list[dict] | None], title: str) -> None:
    """Every run's validation loss against the step on one axes (left), and the same over the
    second half of the steps (right, where the recipes part), as a PNG put in place atomically."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    last = max(int(h[-1]["step"]) for h in runs.values() if h)
    styles = ["-", "--", "-.", ":"]
    for i, (name, history) in enumerate(runs.items()):
        if not history:
            continue
        points = [(int(r["step"]), float(r["validation_loss"])) for r in history]
        for ax, first in ((axes[0], 0), (axes[1], last // 2)):
            shown = [(s, v) for s, v in points if s >= first]
            if shown:
                steps, values = zip(*shown)
                ax.plot(steps, values, styles[i // 10 % 4], marker="o", markersize=3, label=name)
    for ax, which in zip(axes, ("all steps", "second half")):
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats per character)")
        ax.set_title(which)
        ax.grid(alpha=0.3)
    axes[1].legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)

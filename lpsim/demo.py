"""lpsim's main job: train a small CNN on handwritten digits in full precision and in simulated
low-precision recipes, and compare.

    python -m lpsim.demo [--epochs 30] [--out out] [--recipes fp32,bfloat16,ibm8,...]
        [--seed 0] [--threads N]

The data are the 1797 8x8 digit images bundled with scikit-learn (no download), split 80/20 by a
permutation drawn from --seed (so another seed also tests on other images). Every recipe starts
from the same initial weights and sees the same batches; see lpsim.recipes for what each
quantises. By default all of lpsim.recipes.RECIPES run: float32,
bfloat16, IBM8, 8-bit block float, 8-bit fixed point, fixed8-unscaled (the counter-example whose
fixed-point errors, without the loss scale, fall below the format's spacing), MXFP8, MXFP4 and
NVFP4. Prints the test accuracy and wall time (training and the per-epoch evaluation) of every
recipe and writes the accuracy curves to
<out>/digits_accuracy.png and the table to <out>/digits_results.md.

When fixed8 and fixed8-unscaled both run, the demo ends with the reason one fails and the other
trains: the two recipes train again for one epoch with an lpsim.diagnostics.Recorder attached, and
a table shows, per layer, the share of its errors that the rounding flushed to zero and their SQNR
(also written to <out>/digits_diagnosis.md).
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
from torch import nn
from torch.nn.utils import parametrize

from lpsim.diagnostics import Recorder
from lpsim.diagnostics.recorder import percent_text
from lpsim.recipes import RECIPES, Recipe

NAME_WIDTH = max(len(name) for name in RECIPES)  # recipe names line up in the printed lines


def digits(seed: int = 0):
    """(train_x, train_y, test_x, test_y): images as (N, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits  # noqa: PLC0415 - only the demo needs scikit-learn

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def train(recipe: Recipe, data, epochs: int, seed: int = 0, progress: bool = True):
    """Train one recipe; returns (test accuracy per epoch, seconds)."""
    from tqdm import tqdm  # noqa: PLC0415

    train_x, train_y, test_x, test_y = data
    torch.manual_seed(seed)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    model, optimizer = recipe.apply(model, optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    batches = torch.Generator().manual_seed(seed)
    curve = []
    start = time.perf_counter()
    for _ in tqdm(
        range(epochs),
        desc=f"{recipe.name:{NAME_WIDTH}s}",
        unit="epoch",
        disable=not progress,
        leave=False,
    ):
        for idx in torch.randperm(len(train_y), generator=batches).split(64):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
            (loss * recipe.loss_scale).backward()
            optimizer.step()
        scheduler.step()
        curve.append(accuracy(model, test_x, test_y))
    return curve, time.perf_counter() - start


def recorded_epoch(recipe: Recipe, data, seed: int = 0) -> Recorder:
    """train()'s first epoch for ``recipe`` with a Recorder of its errors attached; returns the
    detached recorder."""
    train_x, train_y, _, _ = data
    torch.manual_seed(seed)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    model, optimizer = recipe.apply(model, optimizer)
    batches = torch.Generator().manual_seed(seed)
    with Recorder(model, optimizer, categories=("error",)) as recorder:
        for idx in torch.randperm(len(train_y), generator=batches).split(64):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
            (loss * recipe.loss_scale).backward()
            optimizer.step()
    return recorder


def diagnosis(recorders: dict[str, Recorder]) -> str:
    """Per layer, the share of its errors that the rounding flushed from nonzero to zero and
    their SQNR, for each recorded recipe side by side. Layers whose
    error rounding was exact in every recipe (an error the next layer had rounded already) are
    left out."""
    names = list(recorders)
    errors = {n: r.summary(by=("module", "category")) for n, r in recorders.items()}
    # The names and classes the recorders give the modules: "(model)" for the model itself, and a
    # layer's class as the model was built (Conv2d, not the ParametrizedConv2d that inject's
    # weight quantiser makes of it).
    types = {
        name or "(model)": parametrize.type_before_parametrizations(module).__name__
        for r in recorders.values()
        for name, module in r.model.named_modules()
    }
    header = " | ".join(f"{n}: errors to zero | {n}: error SQNR (dB)" for n in names)
    lines = [f"| layer | {header} |", "|---|" + "---:|---:|" * len(names)]
    modules = sorted({m for e in errors.values() for m, c in e if c == "error"}, key=_layer_order)
    for module in modules:
        found = [errors[n].get((module, "error")) for n in names]
        if all(s is None or s.squared_error == 0 for s in found):
            continue
        cells = []
        for s in found:
            cells += ["", ""] if s is None else [_percent(s.fraction("underflow")), _db(s.sqnr_db)]
        lines.append(f"| {module} ({types.get(module, '')}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _percent(fraction: float) -> str:
    return f"{percent_text(fraction, 1)}%"


def _db(value: float) -> str:
    return f"{value:.1f}"


def _layer_order(name: str) -> tuple:
    """A module name's sort key: numbered parts ("0", "12") in numeric order, before named parts
    ("fc", "(model)"), which sort as text."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def plot(curves: dict[str, list[float]], path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [100 * a for a in curve], label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Small CNN on scikit-learn digits: simulated precision")
    lowest = min(min(curve) for curve in curves.values())
    ax.set_ylim(min(80, 10 * int(10 * lowest)), 100)  # every curve in view, failures included
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict[str, tuple[list[float], float]], epochs: int) -> str:
    lines = [
        f"| recipe | test accuracy after {epochs} epochs | best | wall time (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, (curve, seconds) in results.items():
        lines.append(
            f"| {name} | {100 * curve[-1]:.1f}% | {100 * max(curve):.1f}% | {seconds:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"))
    parser.add_argument("--recipes", type=str, default=",".join(RECIPES))
    parser.add_argument("--seed", type=int, default=0, help="0 to 2**32 - 1 (default: 0)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: torch's, one per core); pass 1 on a machine "
        "whose cores are busy with other work",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be a positive integer, got {args.epochs}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be an integer from 0 to 2**32 - 1, got {args.seed}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    data = digits(args.seed)
    print(
        f"Small CNN on scikit-learn digits: {len(data[1])} training and {len(data[3])} test "
        f"images, {args.epochs} epochs, {torch.get_num_threads()} threads"
    )
    results = {}
    for name in names:
        results[name] = train(RECIPES[name], data, args.epochs, args.seed)
        curve, seconds = results[name]
        print(f"{name:{NAME_WIDTH}s} test accuracy {100 * curve[-1]:5.1f}%  ({seconds:.1f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    plot({n: r[0] for n, r in results.items()}, args.out / "digits_accuracy.png")
    text = table(results, args.epochs)
    (args.out / "digits_results.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwrote {args.out / 'digits_accuracy.png'} and {args.out / 'digits_results.md'}")
    if "fixed8" in names and "fixed8-unscaled" in names:
        recorders = {
            n: recorded_epoch(RECIPES[n], data, args.seed) for n in ("fixed8-unscaled", "fixed8")
        }
        text = diagnosis(recorders)
        (args.out / "digits_diagnosis.md").write_text(text + "\n")
        print(
            "\nWhy fixed8-unscaled fails: its errors, without the loss scale of fixed8 (256), lie "
            "below Fixed(8, 4)'s spacing of 2^-4 and round to zero (first epoch, per layer):\n"
        )
        print(text)
        print(f"\nwrote {args.out / 'digits_diagnosis.md'}")


if __name__ == "__main__":
    main()

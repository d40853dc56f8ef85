"""Iris in float32 and in integers: a 4-8-8-3 MLP (ReLU, MSE loss, batch 32) trained with SGD
whose learning rate and momentum are shifts (lr 2**-lr_shift, momentum 1 - 2**-momentum_shift).

Both paths start from the same initial weights, see the same batches in the same order and use
the same loss, L = (1/2N) sum over the batch and the 3 outputs of (y - t)^2 with one-hot targets,
and the same early-stopping rule, so the arithmetic is the only difference. The integer path
(lpsim.dyadic) converts the standardised features to 8-bit integers once and then runs forward,
loss, backward and update in integer kernels: 8-bit activations and errors, 16-bit weights,
32-bit accumulators, stochastic rounding.

    python -m experiments.iris_int.run            # 10 seeds, writes docs/results/iris_int.md/.png

Prints a per-epoch trace (loss, test accuracy, shifts, clamps) for the first seed every
--log-every epochs, then the summary table beside the published run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import pathlib
import statistics
import time
from dataclasses import dataclass, field

import torch
from sklearn.datasets import load_iris
from sklearn.model_selection import train_test_split

from experiments.runs import positive_int, seed_int, threads_kept
from lpsim import dyadic
from lpsim.dyadic import DyadicTensor
from lpsim.dyadic import nn as inn
from lpsim.dyadic.optim import SGD as IntegerSGD

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("0", "2", "4")  # positions of the Linear layers in the Sequential (stats() keys)


@dataclass(frozen=True)
class Path:
    """One way of training: float32, or integers with a weight width and a rounding rule used by
    every requantisation (layers, loss and optimizer)."""

    label: str
    weight_bits: int | None = None  # None: float32, or the integer path's --weight-bits
    rounding: str = "stochastic"
    colour: str = "tab:red"


# float32, the integer path, and an ablation at 8-bit weights, where a typical update is below
# the weight's quantum: stochastic rounding against nearest (ties to even) and down (the plain
# arithmetic shift).
PATHS = {
    "float32": Path("float32", colour="tab:blue"),
    "integer": Path("integer ({weight_bits}-bit weights), stochastic", 0),
    "w8-stochastic": Path("integer, 8-bit weights, stochastic", 8, colour="tab:orange"),
    "w8-nearest": Path("integer, 8-bit weights, nearest", 8, "nearest", "tab:green"),
    "w8-down": Path("integer, 8-bit weights, down", 8, "down", "tab:gray"),
}
PUBLISHED = {"float32": "90% after 500 epochs", "integer": "95% after 239 epochs (early stopped)"}
THRESHOLDS = (90.0, 95.0)  # test accuracies whose first epoch measures the speed of convergence


def label(name: str, args) -> str:
    """The path's label, with the integer path's weight width as --weight-bits sets it."""
    return PATHS[name].label.format(weight_bits=args.weight_bits)


# ---- data ---------------------------------------------------------------------------------


@dataclass
class Data:
    x_train: torch.Tensor  # standardised features, float32
    y_train: torch.Tensor  # class indices
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_data(split_seed: int) -> Data:
    """Iris (bundled with scikit-learn): a stratified 80/20 split, features standardised with the
    training set's mean and standard deviation."""
    iris = load_iris()
    x_train, x_test, y_train, y_test = train_test_split(
        iris.data, iris.target, test_size=0.2, stratify=iris.target, random_state=split_seed
    )
    x_train = torch.tensor(x_train, dtype=torch.float32)
    x_test = torch.tensor(x_test, dtype=torch.float32)
    mean, std = x_train.mean(0), x_train.std(0)
    return Data(
        (x_train - mean) / std, torch.tensor(y_train), (x_test - mean) / std, torch.tensor(y_test)
    )


# ---- one training run ---------------------------------------------------------------------


@dataclass
class Run:
    """What one path did in one seed."""

    losses: list[float] = field(default_factory=list)  # mean training loss per epoch
    accuracies: list[float] = field(default_factory=list)  # test accuracy (%) after each epoch
    stop_epoch: int | None = None  # early stopping epoch (None: ran to the end)
    trace: list[dict] = field(default_factory=list)  # per-epoch shifts and clamps (integer path)

    @property
    def epochs_run(self) -> int:
        return self.stop_epoch or len(self.accuracies)

    @property
    def stopped_accuracy(self) -> float:
        return self.accuracies[self.epochs_run - 1]

    def first_epoch_reaching(self, accuracy: float) -> int | None:
        return next((e for e, a in enumerate(self.accuracies, 1) if a >= accuracy - 1e-9), None)


class EarlyStopping:
    """Stops when the epoch's training loss has not improved on its best by more than
    ``min_delta`` (relative) for ``patience`` epochs."""

    def __init__(self, patience: int, min_delta: float):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.waited = math.inf, 0

    def should_stop(self, loss: float) -> bool:
        if loss < self.best * (1 - self.min_delta):
            self.best, self.waited = loss, 0
        else:
            self.waited += 1
        return self.waited >= self.patience


def float_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 3),
    )


def batches(n: int, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=generator).split(batch))


def train_float(model, data: Data, args, seed: int) -> Run:
    opt = torch.optim.SGD(
        model.parameters(), lr=2.0**-args.lr_shift, momentum=1 - 2.0**-args.momentum_shift
    )
    order = torch.Generator().manual_seed(seed)
    targets = torch.nn.functional.one_hot(data.y_train, 3).float()
    stopper, run = EarlyStopping(args.patience, args.min_delta), Run()
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for idx in batches(len(data.x_train), args.batch, order):
            opt.zero_grad()
            loss = 0.5 * ((model(data.x_train[idx]) - targets[idx]) ** 2).sum() / len(idx)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        run.losses.append(total / len(data.x_train))
        with torch.no_grad():
            correct = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        run.accuracies.append(100.0 * correct)
        if run.stop_epoch is None and stopper.should_stop(run.losses[-1]):
            run.stop_epoch = epoch
    return run


def integer_model(torch_model: torch.nn.Sequential, args, path: Path) -> inn.Sequential:
    """The integer copy of the float model's initial weights."""
    options = dict(
        weight_bits=path.weight_bits or args.weight_bits,
        activation_bits=args.activation_bits,
        error_bits=args.error_bits,
        rounding=path.rounding,
    )
    layers = []
    for m in torch_model:
        layers.append(
            inn.Linear.from_torch(m, **options) if isinstance(m, torch.nn.Linear) else inn.ReLU()
        )
    return inn.Sequential(*layers)


def train_integer(model: inn.Sequential, data: Data, args, seed: int, rounding: str) -> Run:
    torch.manual_seed(seed)  # the stochastic rounding's seeds come from torch's generator
    scale = dyadic.scale_for(data.x_train, args.activation_bits)  # one scale for the data set
    x_train = dyadic.from_float(data.x_train, args.activation_bits, scale).value
    x_test = dyadic.from_float(data.x_test, args.activation_bits, scale).value
    one_hot = torch.nn.functional.one_hot(data.y_train, 3).to(torch.int32)
    opt = IntegerSGD(
        model.parameters(),
        lr_shift=args.lr_shift,
        momentum_shift=args.momentum_shift,
        grad_bits=args.grad_bits,
        rounding=rounding,
    )
    order = torch.Generator().manual_seed(seed)
    stopper, run = EarlyStopping(args.patience, args.min_delta), Run()
    for epoch in range(1, args.epochs + 1):
        for stats in model.stats().values():
            stats.reset()
        opt.reset_stats()
        total, loss_shifts = 0.0, []
        model.train()
        for idx in batches(len(data.x_train), args.batch, order):
            x = DyadicTensor(x_train.mantissa[idx], x_train.scale)
            out = model(x)
            loss = inn.mse_loss(
                out, DyadicTensor(one_hot[idx], 0), error_bits=args.error_bits, rounding=rounding
            )
            opt.zero_grad()
            model.backward(loss.grad)
            opt.step()
            total += loss.loss * len(idx)
            loss_shifts.append(loss.shift)
        run.losses.append(total / len(data.x_train))
        model.eval()
        predicted = model(x_test).mantissa.argmax(1)
        run.accuracies.append(100.0 * (predicted == data.y_test).float().mean().item())
        run.trace.append(epoch_trace(model, opt, loss_shifts))
        if run.stop_epoch is None and stopper.should_stop(run.losses[-1]):
            run.stop_epoch = epoch
    return run


def epoch_trace(model: inn.Sequential, opt: IntegerSGD, loss_shifts: list[int]) -> dict:
    stats = model.stats()
    trace = {"loss_shift": statistics.fmean(loss_shifts)}
    for number, position in enumerate(LAYERS, start=1):
        s = stats[position].summary()
        trace[f"fwd{number}"] = s["forward_shift"]
        trace[f"bwd{number}"] = s["backward_shift"]
        trace[f"fclamp{number}"] = s["forward_clamps"]
        trace[f"bclamp{number}"] = s["backward_clamps"]
        trace[f"overflow{number}"] = s["overflows"]
    trace["grad_clamps"] = sum(c.gradient for c in opt.stats.values())
    trace["weight_clamps"] = sum(c.weight for c in opt.stats.values())
    return trace


def train_seed(seed: int, args, names: list[str]) -> dict[str, Run]:
    """Every path of one seed, from the same initial weights (runs in a worker process)."""
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    data = load_data(args.split_seed)
    model = float_model(seed)
    copies = {name: integer_model(model, args, PATHS[name]) for name in names[1:]}
    runs = {"float32": train_float(model, data, args, seed)}
    for name, copy in copies.items():
        runs[name] = train_integer(copy, data, args, seed, PATHS[name].rounding)
    return runs


# ---- reporting ----------------------------------------------------------------------------------


def trace_line(epoch: int, fl: Run, it: Run) -> str:
    t = it.trace[epoch - 1]
    shifts = " ".join(f"{t[f'fwd{i}']:.1f}/{t[f'bwd{i}']:.1f}" for i in (1, 2, 3))
    clamps = " ".join(f"{t[f'fclamp{i}']}/{t[f'bclamp{i}']}" for i in (1, 2, 3))
    return (
        f"{epoch:4d}  loss {fl.losses[epoch - 1]:.4f} {it.losses[epoch - 1]:.4f}  "
        f"acc {fl.accuracies[epoch - 1]:5.1f} {it.accuracies[epoch - 1]:5.1f}  "
        f"shift fwd/bwd {shifts}  clamps fwd/bwd {clamps}  "
        f"grad/weight clamps {t['grad_clamps']}/{t['weight_clamps']}"
    )


def spread(values: list[float], digits: int = 1) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    low, high = min(values), max(values)
    return f"{mean:.{digits}f} ± {sd:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def reached(runs: list[Run], accuracy: float) -> str:
    epochs = [r.first_epoch_reaching(accuracy) for r in runs]
    hit = [float(e) for e in epochs if e is not None]
    if not hit:
        return f"never (0/{len(runs)})"
    return f"{spread(hit, 0)} ({len(hit)}/{len(runs)})"


def summary_rows(results: dict[str, list[Run]], args) -> list[str]:
    rows = [
        f"| path | test accuracy after {args.epochs} epochs (%) | early stop: epoch | "
        "early stop: test accuracy (%) | first epoch at >= 90% | first epoch at >= 95% | "
        "published run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        stopped = [r for r in runs if r.stop_epoch is not None]
        stop = (
            f"{spread([float(r.stop_epoch) for r in stopped], 0)} ({len(stopped)}/{len(runs)})"
            if stopped
            else f"none within {args.epochs} (0/{len(runs)})"
        )
        rows.append(
            f"| {label(name, args)} | {spread([r.accuracies[-1] for r in runs])} | {stop} | "
            f"{spread([r.stopped_accuracy for r in runs])} | "
            f"{reached(runs, THRESHOLDS[0])} | {reached(runs, THRESHOLDS[1])} | "
            f"{PUBLISHED.get(name, '')} |"
        )
    return rows


def seed_rows(results: dict[str, list[Run]], seeds: list[int], args) -> list[str]:
    names = list(results)
    rows = [
        "| seed | "
        + " | ".join(f"{label(n, args)}: acc at {args.epochs} / stop epoch" for n in names)
        + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i, seed in enumerate(seeds):
        cells = [
            f"{results[n][i].accuracies[-1]:.1f} / {results[n][i].stop_epoch or '-'}" for n in names
        ]
        rows.append(f"| {seed} | " + " | ".join(cells) + " |")
    return rows


def loss_gap(run: Run, reference: Run) -> float:
    """The largest relative difference between a run's training loss and float32's, per epoch."""
    return max(abs(a - b) / b for a, b in zip(run.losses, reference.losses))


def integer_rows(results: dict[str, list[Run]], args) -> list[str]:
    """Totals over every seed and epoch of each integer path's clamps and overflows, the range of
    its per-epoch mean shifts, and how far its loss strayed from float32's."""
    rows = [
        "| path | forward shift | backward shift | forward clamps | backward clamps | "
        "gradient clamps | weight clamps | accumulator overflows | "
        "largest loss gap to float32 (median, max over seeds) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, runs in results.items():
        if name == "float32":
            continue
        traces = [t for r in runs for t in r.trace]

        def total(key: str, traces=traces) -> int:
            return sum(t[f"{key}{i}"] for t in traces for i in (1, 2, 3))

        def span(key: str, traces=traces) -> str:
            values = [t[f"{key}{i}"] for t in traces for i in (1, 2, 3)]
            return f"{min(values):.2f} to {max(values):.2f}"

        gaps = sorted(loss_gap(r, f) for r, f in zip(runs, results["float32"]))
        rows.append(
            f"| {label(name, args)} | {span('fwd')} | {span('bwd')} | {total('fclamp')} | "
            f"{total('bclamp')} | {sum(t['grad_clamps'] for t in traces)} | "
            f"{sum(t['weight_clamps'] for t in traces)} | {total('overflow')} | "
            f"{statistics.median(gaps):.1%}, {gaps[-1]:.1%} |"
        )
    return rows


def trace_rows(fl: Run, it: Run, every: int) -> list[str]:
    rows = [
        "| epoch | loss float32 | loss integer | acc float32 | acc integer "
        "| shift fwd (L1 L2 L3) | shift bwd (L1 L2 L3) | loss-grad shift | clamps fwd "
        "| clamps bwd | grad / weight clamps |",
        "|---:|---:|---:|---:|---:|---|---|---:|---|---|---|",
    ]
    for epoch in [1] + list(range(every, len(it.trace) + 1, every)):
        t = it.trace[epoch - 1]
        fwd = " ".join(f"{t[f'fwd{i}']:.2f}" for i in (1, 2, 3))
        bwd = " ".join(f"{t[f'bwd{i}']:.2f}" for i in (1, 2, 3))
        fclamp = " ".join(str(t[f"fclamp{i}"]) for i in (1, 2, 3))
        bclamp = " ".join(str(t[f"bclamp{i}"]) for i in (1, 2, 3))
        rows.append(
            f"| {epoch} | {fl.losses[epoch - 1]:.4f} | {it.losses[epoch - 1]:.4f} | "
            f"{fl.accuracies[epoch - 1]:.1f} | {it.accuracies[epoch - 1]:.1f} | {fwd} | "
            f"{bwd} | {t['loss_shift']:.2f} | {fclamp} | {bclamp} | "
            f"{t['grad_clamps']} / {t['weight_clamps']} |"
        )
    return rows


def write_plot(results: dict[str, list[Run]], args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for name, runs in results.items():
        colour = PATHS[name].colour
        for key, ax in (("accuracies", axes[0]), ("losses", axes[1])):
            curves = torch.tensor([getattr(r, key) for r in runs])
            mean = curves.mean(0)
            epochs = torch.arange(1, curves.shape[1] + 1)
            ax.plot(epochs, mean, color=colour, label=f"{label(name, args)} (mean of {len(runs)})")
            ax.fill_between(
                epochs, curves.min(0).values, curves.max(0).values, color=colour, alpha=0.15
            )
    axes[0].set(
        xlabel="epoch",
        ylabel="test accuracy (%)",
        ylim=(0, 102),
        title="Iris 4-8-8-3, test accuracy (mean; band: min to max)",
    )
    axes[1].set(
        xlabel="epoch",
        ylabel="training loss (1/2N) sum (y - t)^2",
        yscale="log",
        title="training loss (float32 and 16-bit integer curves overlap)",
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(results, seeds, args, seconds: float, path: pathlib.Path) -> None:
    lines = [
        "# Iris, float32 and integer-only training (lpsim.dyadic)",
        "",
        f"Written by `{command(args)}` ({seconds:.0f} s wall time on a 2-core CPU). The set-up "
        "and the choices behind it are in [docs/integer.md](../integer.md) and "
        "[experiments/README.md](../../experiments/README.md).",
        "",
        f"4-8-8-3 MLP, ReLU, MSE loss (1/2N) sum (y - t)^2 on one-hot targets, batch {args.batch}, "
        f"SGD with learning rate 2^-{args.lr_shift} and momentum 1 - 2^-{args.momentum_shift}, "
        f"at most {args.epochs} epochs, early stopping when the training loss has not improved "
        f"by {args.min_delta:.0%} for {args.patience} epochs. Iris: 120 training and 30 test "
        f"samples (stratified split, seed {args.split_seed}), so one test sample is 3.3%. "
        f"Integer path: {args.activation_bits}-bit activations and errors, {args.weight_bits}-bit "
        f"weights, {args.grad_bits}-bit clipped gradients, 32-bit accumulators, stochastic "
        "rounding, dynamic shifts. Seeds " + ", ".join(map(str, seeds)) + " (initial weights, "
        "batch order and rounding); mean ± standard deviation [min, max] over seeds.",
        "",
        *summary_rows(results, args),
        "",
        "The published run is one run of the same set-up (lr_shift 7, momentum_shift 1, batch "
        "32); its loss scaling, integer widths and stopping rule are not known to us, so the "
        "comparison is of outcomes, not of identical procedures.",
        "",
        "![test accuracy and loss per epoch](iris_int.png)",
        "",
        "## Integer statistics, all seeds and epochs",
        "",
        "Shifts: the range of the per-epoch mean number of bits a requantisation dropped, over "
        "the three layers (forward: accumulator to activations; backward: propagated error). "
        "Clamps and overflows: totals. Loss gap: the largest relative difference between the "
        "path's training loss and float32's over the epochs of one seed.",
        "",
        *integer_rows(results, args),
        "",
        "## Per seed",
        "",
        *seed_rows(results, seeds, args),
        "",
        f"## Integer path, seed {seeds[0]}: shifts and clamps per epoch",
        "",
        "Shifts are the bits each requantisation dropped, averaged over the epoch's batches "
        f"(forward: the accumulator to {args.activation_bits}-bit activations; backward: the "
        f"propagated error to {args.error_bits} bits; loss-grad: the output error to "
        f"{args.error_bits} bits). Clamps are elements clipped in the epoch.",
        "",
        *trace_rows(results["float32"][0], results["integer"][0], args.log_every),
        "",
    ]
    path.write_text("\n".join(lines))


def fraction_below_one(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.iris_int.run", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seeds", type=positive_int, default=10, help="number of seeds (0, 1, ...)")
    p.add_argument("--epochs", type=positive_int, default=500)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--lr-shift", type=int, default=7, help="learning rate 2**-this (0 to 62)")
    p.add_argument("--momentum-shift", type=int, default=1, help="momentum 1 - 2**-this (0 to 30)")
    p.add_argument("--activation-bits", type=int, default=8, help="2 to 32")
    p.add_argument("--error-bits", type=int, default=8, help="2 to 32")
    p.add_argument("--weight-bits", type=int, default=16, help="the integer path's, 2 to 32")
    p.add_argument("--grad-bits", type=int, default=16, help="2 to 32")
    p.add_argument(
        "--patience", type=positive_int, default=50, help="early stopping's epochs (default 50)"
    )
    p.add_argument(
        "--min-delta",
        type=fraction_below_one,
        default=0.01,
        help="early stopping's relative improvement, in [0, 1) (default 0.01)",
    )
    p.add_argument("--split-seed", type=seed_int, default=0, help="0 to 2**32 - 1")
    p.add_argument("--log-every", type=positive_int, default=25)
    p.add_argument(
        "--ablations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train with 8-bit weights and each rounding rule",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="seeds trained in parallel processes",
    )
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results")
    return p


def command(args: argparse.Namespace) -> str:
    """The command line that repeats the run's results: its set-up always, and every other
    option that differs from its default (--workers and --out do not change the results)."""
    defaults = vars(parser().parse_args([]))
    shown = ("seeds", "epochs", "lr_shift", "momentum_shift", "batch")
    words = ["python -m experiments.iris_int.run"]
    for key, value in vars(args).items():
        if key in ("workers", "out") or (key not in shown and value == defaults[key]):
            continue
        option = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            words.append(option if value else "--no-" + option[2:])
        else:
            words.append(f"{option} {value}")
    return " ".join(words)


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    for option, low, high in (
        ("lr_shift", 0, 62),
        ("momentum_shift", 0, 30),
        ("activation_bits", 2, 32),
        ("error_bits", 2, 32),
        ("weight_bits", 2, 32),
        ("grad_bits", 2, 32),
    ):
        if not low <= getattr(args, option) <= high:
            p.error(
                f"--{option.replace('_', '-')} must be in [{low}, {high}], "
                f"got {getattr(args, option)}"
            )

    seeds = list(range(args.seeds))
    names = list(PATHS) if args.ablations else ["float32", "integer"]
    start = time.perf_counter()
    if args.workers > 1:
        with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
            per_seed = list(pool.map(train_seed, seeds, [args] * len(seeds), [names] * len(seeds)))
    else:
        with threads_kept():  # train_seed runs on one thread; the caller's count comes back
            per_seed = [train_seed(seed, args, names) for seed in seeds]
    results = {name: [runs[name] for runs in per_seed] for name in names}
    fl, it = results["float32"][0], results["integer"][0]
    print(
        f"seed {seeds[0]}, per epoch: loss float32 integer, test accuracy float32 integer, "
        "integer path's shifts fwd/bwd and clamps fwd/bwd per layer"
    )
    for epoch in [1] + list(range(args.log_every, args.epochs + 1, args.log_every)):
        print(trace_line(epoch, fl, it))
    for i, seed in enumerate(seeds):
        print(
            f"seed {seed}: test accuracy after {args.epochs} epochs "
            + ", ".join(f"{name} {results[name][i].accuracies[-1]:.1f}%" for name in names)
        )
    seconds = time.perf_counter() - start
    print("\n".join(summary_rows(results, args)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_plot(results, args, args.out / "iris_int.png")
    write_markdown(results, seeds, args, seconds, args.out / "iris_int.md")
    print(f"wrote {args.out / 'iris_int.md'} and {args.out / 'iris_int.png'}")


if __name__ == "__main__":
    main()

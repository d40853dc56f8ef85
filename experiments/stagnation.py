"""Stagnation of low-precision weights under round to nearest, and how stochastic rounding and
Kahan compensation avoid it.

Part 1, accumulation: 10**5 increments of 1e-4 (a float32) added to a bfloat16 1.0, each sum
computed exactly and rounded into bfloat16 (lpsim.sr_add) by
  - nearest:            each increment is far below half a spacing (2**-8 at 1.0), so x stays 1;
  - stochastic (mode 1): up with probability increment / spacing, E[x] tracks the exact sum;
  - stochastic_equal (mode 2): up or down with probability 1/2, a biased random walk;
  - Kahan:              bfloat16 x and a bfloat16 compensation c, every operation rounded to
                        nearest (y = inc + c, t = x + y, c = y - (t - x), x = t);
beside the exact sum and a float32 accumulator. The stochastic rules run 256 independent copies
(one tensor), so the table gives the mean and standard deviation of the final value.

Part 2, training: logistic regression on scikit-learn's breast_cancer data (569 samples, 30
standardised features and a bias; 70/30 stratified split), full-batch gradient descent with
learning rate 1e-3 for 10**4 steps from zero weights. The forward and backward passes run in
float32 from the stored weights; the weight storage and update differ: float32
(torch.optim.SGD) against bfloat16 weights updated by lpsim.optim.SGD with nearest, stochastic
(three seeds), stochastic_equal (three seeds) and Kahan-compensated nearest. The gradient of
bfloat16 weights is bfloat16 too: autograd rounds the float32 gradient to nearest bfloat16 (a
parameter's gradient has its dtype), and the update w - lr * g is then exact and rounded once.

    python -m experiments.stagnation    # writes docs/results/stagnation.{md,png}
    python -m experiments.stagnation --out DIR    # writes DIR/stagnation.{md,png} instead

14 to 27 minutes on a 2-core machine (836 s and 1603 s measured, both while it was shared); prints
a line per tenth of the accumulation and per training run as it goes.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import lpsim  # noqa: E402
from experiments.runs import positive_float, positive_int  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BF16 = lpsim.Float(8, 7)


# ---- Part 1: accumulation


def accumulate(steps: int, copies: int, record_every: int) -> dict:
    """Trajectories (recorded every record_every steps) and final values of each method. Prints a
    line after every tenth of the steps."""
    began = time.time()
    report_at = {steps * k // 10 for k in range(1, 11)}
    inc = torch.full((copies,), 1e-4)  # float32: 1e-4 rounded to float32
    one = torch.ones(copies, dtype=torch.bfloat16)
    x = {
        "nearest": one.clone(),
        "stochastic": one.clone(),
        "stochastic_equal": one.clone(),
        "kahan": one[:1].clone(),
    }
    compensation = torch.zeros(1, dtype=torch.bfloat16)
    f32 = torch.ones(1)
    traces = {name: [] for name in list(x) + ["float32"]}
    recorded = []
    for step in range(1, steps + 1):
        for rule in ("nearest", "stochastic", "stochastic_equal"):
            lpsim.sr_add_(x[rule], inc, BF16, rule, seed=2024, offset=step)
        y = lpsim.sr_add(compensation, inc[:1], BF16, "nearest")
        t = lpsim.sr_add(x["kahan"], y, BF16, "nearest")
        gained = lpsim.sr_add(t, x["kahan"].neg(), BF16, "nearest")
        compensation = lpsim.sr_add(y, gained.neg(), BF16, "nearest")
        x["kahan"] = t
        f32 += inc[0]
        if step % record_every == 0:
            recorded.append(step)
            for name, value in x.items():
                traces[name].append(value.double().mean().item())
            traces["float32"].append(f32.item())
        if step in report_at:
            print(
                f"accumulation: {step}/{steps} increments ({time.time() - began:.0f} s)", flush=True
            )
    exact = 1.0 + steps * float(inc[0])
    final = {name: value.double() for name, value in x.items()}
    final["float32"] = f32.double()
    overflow = next(
        (s for s, v in zip(recorded, traces["stochastic_equal"]) if v == float("inf")), None
    )
    return {
        "steps": recorded,
        "traces": traces,
        "final": final,
        "exact": exact,
        "increment": float(inc[0]),
        "overflow": overflow,
    }


# ---- Part 2: logistic regression


def breast_cancer():
    data = load_breast_cancer()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=0.3, random_state=0, stratify=data.target
    )
    mean, std = x_train.mean(0), x_train.std(0)

    def features(x):
        x = torch.tensor((x - mean) / std, dtype=torch.float32)
        return torch.cat([x, torch.ones(len(x), 1)], 1)  # the last weight is the bias

    return (
        features(x_train),
        torch.tensor(y_train, dtype=torch.float32),
        features(x_test),
        torch.tensor(y_test, dtype=torch.float32),
    )


def train(method: str, seed: int, data, steps: int, lr: float, record_every: int) -> dict:
    x_train, y_train, x_test, y_test = data
    dtype = torch.float32 if method == "float32" else torch.bfloat16
    w = torch.zeros(x_train.shape[1], dtype=dtype, requires_grad=True)
    if method == "float32":
        opt = torch.optim.SGD([w], lr=lr)
    elif method == "kahan":
        opt = lpsim.optim.SGD([w], lr=lr, rounding="nearest", kahan=True)
    else:
        opt = lpsim.optim.SGD([w], lr=lr, rounding=method, seed=seed)
    losses, accuracies, last_change = [], [], 0

    def test_accuracy(weights: torch.Tensor) -> float:
        with torch.no_grad():
            return ((x_test @ weights.float() > 0).float() == y_test).float().mean().item()

    for step in range(1, steps + 1):
        before = w.detach().clone()
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x_train @ w.float(), y_train)
        loss.backward()
        opt.step()
        if not torch.equal(before, w.detach()):
            last_change = step
        if step % record_every == 0 or step in (1, steps):
            with torch.no_grad():
                losses.append((step, loss.item()))
                accuracies.append((step, test_accuracy(w)))
    with torch.no_grad():
        final_loss = torch.nn.functional.binary_cross_entropy_with_logits(
            x_train @ w.float(), y_train
        ).item()
    return {
        "losses": losses,
        "accuracies": accuracies,
        "final_loss": final_loss,
        "accuracy": test_accuracy(w),
        "last_change": last_change,
        "max_weight": w.detach().float().abs().max().item(),
    }


# ---- Report

LABELS = {
    "nearest": "nearest",
    "stochastic": "stochastic (mode 1)",
    "stochastic_equal": "stochastic_equal (mode 2)",
    "kahan": "Kahan (nearest)",
    "float32": "float32",
}
COLORS = {
    "nearest": "tab:red",
    "stochastic": "tab:blue",
    "stochastic_equal": "tab:orange",
    "kahan": "tab:green",
    "float32": "black",
}


def steps_label(lr: float) -> str:
    """The training panels' x label, with the learning rate of the run."""
    return f"gradient steps (lr {lr:g})"


def plot(acc: dict, runs: dict, lr: float, path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    exact = [1.0 + k * acc["increment"] for k in acc["steps"]]
    ax.plot(acc["steps"], exact, color="grey", linewidth=4, alpha=0.4, label="exact sum")
    for name, trace in acc["traces"].items():
        style = "--" if name == "float32" else "-"
        ax.plot(acc["steps"], trace, style, color=COLORS[name], label=LABELS[name])
    top = 1.25 * acc["exact"]
    ax.set_ylim(0, top)
    if acc["overflow"] is not None:
        ax.annotate(
            f"mode 2 leaves the plot at once\nand overflows to Inf by step {acc['overflow']}",
            xy=(acc["steps"][1], top * 0.97),
            xytext=(acc["steps"][-1] * 0.08, top * 0.88),
            fontsize=8,
            color=COLORS["stochastic_equal"],
            arrowprops=dict(arrowstyle="->", color=COLORS["stochastic_equal"]),
        )
    ax.set_xlabel("increments of 1e-4 added")
    ax.set_ylabel("bfloat16 accumulator (mean of the copies)")
    ax.set_title("1.0 + sum of 1e-4, rounded into bfloat16")
    ax.legend(fontsize=8, loc="lower right")
    for ax, key, title in (
        (axes[1], "losses", "training loss"),
        (axes[2], "accuracies", "test accuracy"),
    ):
        for method, seeds in runs.items():
            for i, run in enumerate(seeds):
                steps, values = zip(*run[key])
                ax.plot(
                    steps,
                    values,
                    color=COLORS[method],
                    alpha=1.0 if i == 0 else 0.4,
                    label=LABELS[method] if i == 0 else None,
                )
        ax.set_xlabel(steps_label(lr))
        ax.set_title(f"logistic regression, breast_cancer: {title}")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("cross-entropy (train)")
    axes[2].set_ylim(0.85, 1.0)
    axes[2].set_ylabel("accuracy (test, 171 samples)")
    axes[2].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(acc: dict, runs: dict, seconds: float, args) -> str:
    lines = [
        "# Stagnation: bfloat16 weights under nearest and stochastic rounding",
        "",
        "Written by `python -m experiments.stagnation` "
        f"({seconds:.0f} s on this machine). See experiments/README.md for the set-up.",
        "",
        f"## Accumulation: 1.0 + {args.increments} x 1e-4 in bfloat16",
        "",
        f"The exact sum is {acc['exact']:.6f} (1e-4 as a float32). Stochastic rules: {args.copies} "
        "independent copies.",
        "",
        "| method | final value (mean) | std over copies | error of the mean |",
        "|---|---:|---:|---:|",
    ]
    for name in ("nearest", "stochastic", "stochastic_equal", "kahan", "float32"):
        v = acc["final"][name]
        mean = v.mean().item()
        # One copy has no spread; copies that overflowed have no finite one.
        if v.numel() == 1:
            std = "0"
        elif v.isfinite().all():
            std = f"{v.std().item():.3g}"
        else:
            std = f"n/a ({int((~v.isfinite()).sum())} of {v.numel()} copies not finite)"
        err = mean - acc["exact"]
        lines.append(f"| {LABELS[name]} | {mean:.6g} | {std} | {err:+.3g} |")
    if acc["overflow"] is not None:
        lines += [
            "",
            f"Mode 2 overflows: the mean is Inf from step {acc['overflow']} on (recorded "
            f"every {acc['steps'][0]} steps).",
        ]
    lines += [
        "",
        f"## Logistic regression on breast_cancer ({args.steps} full-batch steps, lr {args.lr})",
        "",
        "| weights | seed | final train loss | test accuracy | last step that changed a weight | "
        "largest weight |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, seeds in runs.items():
        for seed, run in enumerate(seeds):
            lines.append(
                f"| {LABELS[method]}{'' if method == 'float32' else ' (bfloat16)'} | "
                f"{seed if len(seeds) > 1 else '-'} | {run['final_loss']:.4f} | "
                f"{run['accuracy']:.4f} | {run['last_change']} | {run['max_weight']:.3g} |"
            )
    lines += ["", "![stagnation](stagnation.png)", ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.stagnation", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--increments", type=positive_int, default=100_000, help="increments added (default 10**5)"
    )
    p.add_argument(
        "--copies",
        type=positive_int,
        default=256,
        help="independent copies of the stochastic sums (default 256)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=10_000, help="training steps (default 10**4)"
    )
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--seeds", type=positive_int, default=3, help="seeds of the stochastic rules (default 3)"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=RESULTS,
        metavar="DIR",
        help="directory for stagnation.md and stagnation.png (default: docs/results, "
        "where the committed results are regenerated; give another for trial runs)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    start = time.time()
    acc = accumulate(args.increments, args.copies, record_every=max(1, args.increments // 400))
    print(f"accumulation done in {time.time() - start:.0f} s", flush=True)
    data = breast_cancer()
    methods = ("float32", "nearest", "stochastic", "stochastic_equal", "kahan")
    configurations = [
        (method, seed)
        for method in methods
        for seed in (range(args.seeds) if method.startswith("stochastic") else [0])
    ]
    runs = {method: [] for method in methods}
    for k, (method, seed) in enumerate(configurations, 1):
        run = train(method, seed, data, args.steps, args.lr, record_every=50)
        runs[method].append(run)
        print(
            f"training [{k}/{len(configurations)}] {method}, seed {seed}: loss "
            f"{run['final_loss']:.4f}, accuracy {run['accuracy']:.4f} "
            f"({time.time() - start:.0f} s)",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(acc, runs, args.lr, args.out / "stagnation.png")
    report = table(acc, runs, time.time() - start, args)
    (args.out / "stagnation.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()

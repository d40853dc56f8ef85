"""Training under low-precision accumulators: the demo's small CNN (lpsim.demo) trained with every
product of every Conv2d and Linear, forward and backward, summed in a float16 or bfloat16
accumulator (lpsim.MAC, sequential along K, exact products of the float32 operands), by round to
nearest and by stochastic rounding, against torch's float32.

Nothing else is rounded: weights, activations, errors and the optimizer stay in float32, so every
difference comes from the accumulators. Every configuration starts from the same weights and sees
the same batches (lpsim.demo.train). The long sums are the weight gradients: a conv layer's sums
run over the batch and the positions, K = 64 x 8 x 8 = 4096 terms for the first two layers, where
a float16 accumulator rounding to nearest stagnates once the sum is 2^11 times its terms (its unit
roundoff is 2^-11) and bfloat16's already at 2^8. Stochastic rounding is unbiased, so its sums do
not stagnate (Connolly, Higham and Mary, SIAM J. Sci. Comput. 2021).

Two tables: the test accuracy after each epoch, and, on the first batch from the initial weights,
the relative error ||g_hat - g|| / ||g|| of every layer's weight gradient against float32's.

    python -m experiments.mac_training     # 10 epochs; writes docs/results/mac_training.{md,png}
    python -m experiments.mac_training --epochs 2 --configs fp32,bf16-nearest --out DIR
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
from torch import nn

from experiments.runs import positive_int, seed_int
from lpsim import MAC, Float
from lpsim.demo import digits, plot, small_cnn, train
from lpsim.recipes import Recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

FLOAT16 = Float(5, 10)
BFLOAT16 = Float(8, 7)

# Every weight layer simulated (keep_edges=False): the first and last layers' sums are no safer.
CONFIGS = {
    "fp32": Recipe("fp32"),
    "bf16-nearest": Recipe("bf16-nearest", mac=MAC(accumulator=BFLOAT16), keep_edges=False),
    "bf16-stochastic": Recipe(
        "bf16-stochastic", mac=MAC(accumulator=BFLOAT16, rounding="stochastic"), keep_edges=False
    ),
    "fp16-nearest": Recipe("fp16-nearest", mac=MAC(accumulator=FLOAT16), keep_edges=False),
    "fp16-stochastic": Recipe(
        "fp16-stochastic", mac=MAC(accumulator=FLOAT16, rounding="stochastic"), keep_edges=False
    ),
}


def first_batch_gradients(recipe: Recipe, data, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight layer's weight gradient on train()'s first batch, from its initial weights."""
    train_x, train_y, _, _ = data
    torch.manual_seed(seed)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, _ = recipe.apply(model, optimizer)
    idx = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))[:64]
    nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
    return {
        f"{name} ({type(module).__name__})": module.weight.grad.clone()
        for name, module in model.named_modules()
        if isinstance(module, (nn.Conv2d, nn.Linear))
    }


def write(results: dict, errors: dict, args, seconds: float) -> None:
    names = list(results)
    epochs, out, threads = args.epochs, args.out, torch.get_num_threads()
    command = (
        f"python -m experiments.mac_training --epochs {epochs} --seed {args.seed} "
        f"--configs {','.join(names)} --threads {threads}"
    )
    lines = [
        "# Training the demo CNN under low-precision accumulators",
        "",
        f"Written by `{command}` ({seconds:.0f} s on this machine, "
        f"{threads} thread{'s' if threads > 1 else ''}). Every Conv2d and Linear product, "
        "forward and backward, summed sequentially in the accumulator (exact products of float32 "
        "operands); nothing else rounded. Same initial weights and batches for every "
        "configuration.",
        "",
        "![test accuracy per epoch](mac_training.png)",
        "",
        f"## Test accuracy (%) after {epochs} epochs",
        "",
        "| configuration | final | best | wall time (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, (curve, wall) in results.items():
        lines.append(f"| {name} | {100 * curve[-1]:.1f} | {100 * max(curve):.1f} | {wall:.0f} |")
    lines += [
        "",
        "## Weight gradients on the first batch: relative error against float32",
        "",
        "| layer | " + " | ".join(n for n in names if n != "fp32") + " |",
        "|---|" + "---:|" * (len(names) - 1),
    ]
    reference = errors["fp32"]
    for layer in reference:
        cells = []
        for name in names:
            if name == "fp32":
                continue
            g, g0 = errors[name][layer], reference[layer]
            cells.append(f"{((g - g0).norm() / g0.norm()).item():.2e}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines.append("")
    (out / "mac_training.md").write_text("\n".join(lines))
    plot({n: r[0] for n, r in results.items()}, out / "mac_training.png")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=pathlib.Path, default=RESULTS, help="where to write (default: docs/results)"
    )
    p.add_argument(
        "--epochs", type=positive_int, default=10, help="epochs per configuration (default 10)"
    )
    p.add_argument(
        "--configs",
        default="fp32,bf16-nearest,bf16-stochastic,fp16-nearest,fp16-stochastic",
        help=f"comma-separated, from {', '.join(CONFIGS)}; fp32 is always run",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0, help="data split, weights and batches (default 0)"
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, help="CPU threads (default: torch's)"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    names = ["fp32"] + [n for n in args.configs.split(",") if n != "fp32"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        run(args, names)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process keeps its setting


def run(args, names: list[str]) -> None:
    """The experiment for parsed arguments: trains ``names``, writes the table and plot."""
    data = digits(args.seed)
    start = time.perf_counter()
    results, errors = {}, {}
    for name in names:
        errors[name] = first_batch_gradients(CONFIGS[name], data, args.seed)
        results[name] = train(CONFIGS[name], data, args.epochs, args.seed, progress=False)
        curve, wall = results[name]
        print(f"{name:16s} test accuracy {100 * curve[-1]:5.1f}%  ({wall:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write(results, errors, args, time.perf_counter() - start)
    print(f"wrote {args.out / 'mac_training.md'} and mac_training.png")


if __name__ == "__main__":
    main()

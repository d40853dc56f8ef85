"""Time per training step of the CIFAR10 recipes against float32, eager and torch.compile'd.

    python benchmarks/bench_training.py [--models resnet18,vgg16,vgg7] [--recipes fp16,...]
        [--batch-size B] [--repeat N] [--warmup W] [--no-compile] [--device cpu|cuda] [--width W]
        [--threads N]

A step is zero_grad, forward, loss, backward and optimizer step on 32x32 random inputs. Every
recipe of experiments/cifar10/recipes.py is applied to each model with the code the trainer uses
(its quantiser placement, OptimLP with its formats); resnet18 is torchvision's, vgg16 the CIFAR
VGG16 of the recipes. WAGE needs a network without biases and batch norm, so it runs on vgg7 only.
The float32 baseline is the same model with plain SGD (momentum 0.9).

For each (model, recipe) pair the float32 step and the recipe's step are timed alternately,
--repeat times each after --warmup steps each, and the ratio compares their medians: both were
measured over the same stretch of time, so drifts in machine load cancel. With torch.compile
(default mode; the optimizer step stays eager) the same is done for the compiled models, and the
time the first compiled steps took is reported.

CPU: batch 8 by default (the CPU section always runs unless --device cuda). GPU, when present:
batch 128, each step bracketed by torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch
import torchvision

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from experiments.cifar10.models import build_model  # noqa: E402
from experiments.cifar10.recipes import RECIPES  # noqa: E402

MODELS = ("resnet18", "vgg16", "vgg7")
QUANTISED = [name for name in RECIPES if name != "fp32"]


def make_model(name: str, width: float) -> torch.nn.Module:
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    return build_model(name, width=width)


def pairs(models, recipes) -> list[tuple[str, str]]:
    """(model, recipe) pairs to time: WAGE on vgg7 only, the others on resnet18 and vgg16."""
    chosen = []
    for model in models:
        for recipe in recipes:
            if (recipe == "wage") == (model == "vgg7"):
                chosen.append((model, recipe))
    return chosen


class Step:
    """One training step of a model under a recipe (None: float32) on fixed random data."""

    def __init__(self, model_name: str, recipe: str | None, args, device: torch.device):
        torch.manual_seed(0)
        model = make_model(model_name, args.width).to(device)
        if recipe is None:
            self.recipe = RECIPES["fp32"]
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        else:
            self.recipe = RECIPES[recipe]
            model, self.optimizer = self.recipe.prepare(model, self.recipe.lr)
        self.model = model
        self.net = torch.compile(model) if args.compiled else model
        self.x = torch.randn(args.batch_size, 3, 32, 32, device=device)
        self.y = torch.randint(0, 10, (args.batch_size,), device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        """Run one step; its wall time in seconds."""
        self.sync()
        start = time.perf_counter()
        loss, _ = self.recipe.criterion(self.net(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        (loss * self.recipe.loss_scale).backward()
        self.optimizer.step()
        self.sync()
        return time.perf_counter() - start


def alternate(base: Step, other: Step, warmup: int, repeat: int) -> tuple[float, float, float]:
    """(median base step, median other step, seconds of the other's warm-up steps), timed
    alternately."""
    warm = 0.0
    for _ in range(warmup):
        base()
        warm += other()
    ours, theirs = [], []
    for _ in range(repeat):
        ours.append(base())
        theirs.append(other())
    return statistics.median(ours), statistics.median(theirs), warm


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )


def run(args, device: torch.device) -> list[dict]:
    rows = []
    modes = [False, True] if args.compile else [False]
    print(
        f"device: {machine(device)}; batch {args.batch_size}, 32x32 inputs, medians of "
        f"{args.repeat} steps after {args.warmup} warm-up steps, timed alternately with float32"
    )
    header = (
        f"{'model':9s} {'recipe':7s} {'mode':8s} {'fp32 ms':>9s} {'recipe ms':>10s} "
        f"{'ratio':>7s} {'warm-up s':>10s}"
    )
    print(header)
    print("-" * len(header))
    for compiled in modes:
        args.compiled = compiled
        for model_name in args.models:
            torch._dynamo.reset()  # a fresh cache for each model's instances
            base = None
            for m, recipe in pairs([model_name], args.recipes):
                base = base or Step(model_name, None, args, device)
                step = Step(m, recipe, args, device)
                fp32, ours, warm = alternate(base, step, args.warmup, args.repeat)
                row = {
                    "model": m,
                    "recipe": recipe,
                    "mode": "compiled" if compiled else "eager",
                    "fp32_ms": 1e3 * fp32,
                    "recipe_ms": 1e3 * ours,
                    "ratio": ours / fp32,
                    "warmup_s": warm,
                }
                rows.append(row)
                print(
                    f"{m:9s} {recipe:7s} {row['mode']:8s} {row['fp32_ms']:9.1f} "
                    f"{row['recipe_ms']:10.1f} {row['ratio']:6.2f}x {warm:10.1f}",
                    flush=True,
                )
                del step
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as the table of docs/performance.md: eager and compiled side by side."""
    lines = [
        "| model | recipe | fp32 eager ms | recipe eager ms | eager ratio | fp32 compiled ms "
        "| recipe compiled ms | compiled ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    compiled = {(r["model"], r["recipe"]): r for r in rows if r["mode"] == "compiled"}
    for r in rows:
        if r["mode"] != "eager":
            continue
        c = compiled.get((r["model"], r["recipe"]))
        tail = (
            f"{c['fp32_ms']:.1f} | {c['recipe_ms']:.1f} | {c['ratio']:.2f}x" if c else "- | - | -"
        )
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['fp32_ms']:.1f} | {r['recipe_ms']:.1f} "
            f"| {r['ratio']:.2f}x | {tail} |"
        )
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--recipes", default=",".join(QUANTISED))
    p.add_argument("--batch-size", type=int, help="default: 8 on CPU, 128 on GPU")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="default: the CPU section, then the GPU section when CUDA is available",
    )
    p.add_argument(
        "--width",
        type=float,
        default=1.0,
        help="channel multiplier of vgg16 and vgg7 (1: the published networks)",
    )
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.recipes = args.recipes.split(",")
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for r in args.recipes:
        if r not in QUANTISED:
            p.error(f"unknown recipe {r!r}; choose from {', '.join(QUANTISED)}")
    if args.repeat < 1 or args.warmup < 1:
        p.error("--repeat and --warmup must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = (
        [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    )
    batch = args.batch_size
    rows = []
    for name in devices:
        args.batch_size = batch or (128 if name == "cuda" else 8)
        section = run(args, torch.device(name))
        print()
        print(markdown(section))
        print()
        rows += section
    return rows


if __name__ == "__main__":
    main()

"""Time per training step of the CIFAR10 recipes against float32, eager and torch.compile'd.

    python benchmarks/bench_training.py [--models resnet18,vgg16,vgg7] [--recipes fp16,...]
        [--batch-sizes 8,32] [--repeat N] [--warmup W] [--no-compile] [--device cpu|cuda]
        [--width W] [--threads N] [--json PATH] [--compare BEFORE.json]

A step is forward, loss, zero_grad, backward (together: "forward+backward") and the optimizer
step on 32x32 random inputs; each part is timed on its own. Every recipe of
experiments/cifar10/recipes.py is applied to each model with the code the trainer uses (its
quantiser placement, OptimLP with its formats); resnet18 is torchvision's, vgg16 the CIFAR VGG16 of
the recipes. WAGE needs a network without biases and batch norm, so it runs on vgg7 only. Two
recipes exist only here, for the per-call overhead of deterministic rounding: fp16-nearest (the
fp16 recipe with round-to-nearest everywhere) and bf16-nearest (lpsim.recipes.BFLOAT16's formats,
bfloat16 with round-to-nearest, placed as fp16's). The float32 baseline of a recipe is the same
model with the same torch SGD settings (momentum and weight decay: 0.9 and 5e-4 for most recipes,
none for WAGE) and no quantisation, so that the ratios measure the simulation alone.

For each (model, recipe, batch size) the float32 step and the recipe's step are timed
alternately, --repeat times each after --warmup steps each, and each ratio compares medians: both
were measured over the same stretch of time, so drifts in machine load cancel. The optimizer ratio
is the recipe's optimizer step over float32's. With torch.compile (default mode; the optimizer
step stays eager) the same is done for the compiled models, and the time the first compiled steps
took is reported.

--json writes the rows; --compare reads rows written before (by an older lpsim, say) and prints
both side by side.

CPU: batch 8 by default (the CPU section always runs unless --device cuda). GPU, when present:
batch 128, each step bracketed by torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import sys
import time

import torch
import torchvision

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench_options import positive_float  # noqa: E402 - benchmarks/ is on sys.path

from experiments.cifar10.models import build_model  # noqa: E402
from experiments.cifar10.recipes import RECIPES as CIFAR_RECIPES  # noqa: E402
from lpsim import Float, recipes  # noqa: E402

MODELS = ("resnet18", "vgg16", "vgg7")


def _nearest(name: str, fmt) -> object:
    """The fp16 recipe with ``fmt`` and round-to-nearest in every category."""
    spec = (fmt, "nearest")
    quantization = dataclasses.replace(
        recipes.FP32, name=name, weight=spec, activation=spec, error=spec, grad=spec, momentum=spec
    )
    summary = f"{fmt!r} weights, activations, errors, gradients and momentum; round to nearest"
    return dataclasses.replace(
        CIFAR_RECIPES["fp16"], name=name, quantization=quantization, summary=summary
    )


RECIPES = {
    **CIFAR_RECIPES,
    "fp16-nearest": _nearest("fp16-nearest", Float(5, 10)),
    "bf16-nearest": _nearest("bf16-nearest", recipes.BFLOAT16.weight[0]),
}
QUANTISED = [name for name in RECIPES if name != "fp32"]
DEFAULT_RECIPES = [name for name in CIFAR_RECIPES if name != "fp32"]


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
    """One training step of a model under a recipe on fixed random data; with ``float32``, the
    float32 step of that recipe: the same model and SGD settings (momentum, weight decay) without
    quantisation."""

    def __init__(
        self, model_name: str, recipe: str, args, device: torch.device, float32: bool = False
    ):
        torch.manual_seed(0)
        model = make_model(model_name, args.width).to(device)
        if float32:
            settings = RECIPES[recipe]
            self.recipe = RECIPES["fp32"]
            self.optimizer = torch.optim.SGD(
                model.parameters(),
                lr=0.01,
                momentum=settings.momentum,
                weight_decay=settings.weight_decay,
            )
        else:
            self.recipe = RECIPES[recipe]
            model, self.optimizer = self.recipe.prepare(model, self.recipe.lr)
        self.model = model
        self.net = torch.compile(model) if args.compiled else model
        # The inputs come from a generator of their own: the recipe's set-up draws from torch's
        # (stochastic roundings of the weights), and the float32 step and the recipe's step are
        # to run on the same data.
        data = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch_size, 3, 32, 32, generator=data).to(device)
        self.y = torch.randint(0, 10, (args.batch_size,), generator=data).to(device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> tuple[float, float]:
        """Run one step; (forward+backward, optimizer step) wall times in seconds."""
        self.sync()
        start = time.perf_counter()
        loss, _ = self.recipe.criterion(self.net(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        (loss * self.recipe.loss_scale).backward()
        self.sync()
        middle = time.perf_counter()
        self.optimizer.step()
        self.sync()
        return middle - start, time.perf_counter() - middle


def alternate(base: Step, other: Step, warmup: int, repeat: int) -> dict:
    """Medians of the two steps' parts (fp32_fb, fp32_opt, fp32 = their sum per step, and the same
    for ``recipe``) and the seconds of the other's warm-up steps, timed alternately."""
    warm = 0.0
    for _ in range(warmup):
        base()
        warm += sum(other())
    keys = ("fp32_fb", "fp32_opt", "fp32", "recipe_fb", "recipe_opt", "recipe")
    times = {key: [] for key in keys}
    for _ in range(repeat):
        for label, step in (("fp32", base), ("recipe", other)):
            fb, opt = step()
            times[label + "_fb"].append(fb)
            times[label + "_opt"].append(opt)
            times[label].append(fb + opt)
    medians = {key + "_ms": 1e3 * statistics.median(values) for key, values in times.items()}
    return {**medians, "warmup_s": warm}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )


def run(args, device: torch.device, batch_size: int) -> list[dict]:
    rows = []
    modes = [False, True] if args.compile else [False]
    args.batch_size = batch_size
    print(
        f"device: {machine(device)}; batch {batch_size}, 32x32 inputs, medians of "
        f"{args.repeat} steps after {args.warmup} warm-up steps, timed alternately with float32"
    )
    header = (
        f"{'model':9s} {'recipe':13s} {'mode':8s} {'fp32 ms':>9s} {'recipe ms':>10s} "
        f"{'ratio':>7s} {'fwd+bwd':>8s} {'opt':>7s} {'warm-up s':>10s}"
    )
    print(header)
    print("-" * len(header))
    for compiled in modes:
        args.compiled = compiled
        for model_name in args.models:
            torch._dynamo.reset()  # a fresh cache for each model's instances
            bases = {}  # float32 steps by SGD settings
            for m, recipe in pairs([model_name], args.recipes):
                settings = (m, RECIPES[recipe].momentum, RECIPES[recipe].weight_decay)
                if settings not in bases:
                    bases[settings] = Step(m, recipe, args, device, float32=True)
                base = bases[settings]
                step = Step(m, recipe, args, device)
                row = {
                    "model": m,
                    "recipe": recipe,
                    "mode": "compiled" if compiled else "eager",
                    "batch": batch_size,
                    **alternate(base, step, args.warmup, args.repeat),
                }
                row["ratio"] = row["recipe_ms"] / row["fp32_ms"]
                row["fb_ratio"] = row["recipe_fb_ms"] / row["fp32_fb_ms"]
                row["opt_ratio"] = row["recipe_opt_ms"] / row["fp32_opt_ms"]
                rows.append(row)
                print(
                    f"{m:9s} {recipe:13s} {row['mode']:8s} {row['fp32_ms']:9.1f} "
                    f"{row['recipe_ms']:10.1f} {row['ratio']:6.2f}x {row['fb_ratio']:7.2f}x "
                    f"{row['opt_ratio']:6.2f}x {row['warmup_s']:10.1f}",
                    flush=True,
                )
                del step
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as the table of docs/performance.md: per model, recipe and batch, the eager step
    split into forward+backward and optimizer, and the compiled step."""
    lines = [
        "| model | recipe | batch | fp32 eager ms | recipe eager ms | eager ratio "
        "| fwd+bwd ratio | optimizer ratio | compiled ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    compiled = {(r["model"], r["recipe"], r["batch"]): r for r in rows if r["mode"] == "compiled"}
    for r in rows:
        if r["mode"] != "eager":
            continue
        c = compiled.get((r["model"], r["recipe"], r["batch"]))
        compiled_ratio = f"{c['ratio']:.2f}x" if c else "-"
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['batch']} | {r['fp32_ms']:.1f} "
            f"| {r['recipe_ms']:.1f} | {r['ratio']:.2f}x | {r['fb_ratio']:.2f}x "
            f"| {r['opt_ratio']:.2f}x | {compiled_ratio} |"
        )
    return "\n".join(lines)


def comparison(before: list[dict], after: list[dict]) -> str:
    """A markdown table of the ratios measured before and after, for the rows both have."""
    key = lambda r: (r["model"], r["recipe"], r["batch"], r["mode"])  # noqa: E731
    earlier = {key(r): r for r in before}
    lines = [
        "| model | recipe | batch | mode | ratio before | ratio after | optimizer before "
        "| optimizer after |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in after:
        b = earlier.get(key(r))
        if b is None:
            continue
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['batch']} | {r['mode']} | {b['ratio']:.2f}x "
            f"| {r['ratio']:.2f}x | {b['opt_ratio']:.2f}x | {r['opt_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help=", ".join(QUANTISED))
    p.add_argument(
        "--batch-sizes",
        "--batch-size",
        dest="batch_sizes",
        help="comma-separated; default: 8 on CPU, 128 on GPU",
    )
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
        type=positive_float,
        default=1.0,
        help="channel multiplier of vgg16 and vgg7 (1: the published networks)",
    )
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--json", type=pathlib.Path, help="write the rows to this file")
    p.add_argument("--compare", type=pathlib.Path, help="rows written before by --json")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.recipes = args.recipes.split(",")
    if args.batch_sizes is not None:
        try:
            args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
        if min(args.batch_sizes) < 1:
            p.error("--batch-sizes must be at least 1")
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
    rows = []
    for name in devices:
        for batch in args.batch_sizes or [128 if name == "cuda" else 8]:
            section = run(args, torch.device(name), batch)
            print()
            print(markdown(section))
            print()
            rows += section
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.compare:
        print(comparison(json.loads(args.compare.read_text()), rows))
    return rows


if __name__ == "__main__":
    main()

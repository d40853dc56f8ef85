"""Quantisation error of lpsim's scaled formats (MX, NVFP4, scaled FP8) on a trained model's
weights, activations and gradients, as the signal-to-quantisation-noise ratio (SQNR, in dB), with
and without a random Hadamard transform.

Models: (a) lpsim.demo's small CNN trained on scikit-learn's digits in float32 by the demo's own
training loop (lpsim.demo.train with the fp32 recipe); (b) torchvision's resnet18 (10 classes)
trained for a few dozen SGD steps on inputs drawn from a Student-t distribution with few degrees
of freedom (heavy tails) and random labels, so that its weights leave their initialisation and
its activations and gradients carry outliers. After training, one forward and backward pass on a
batch (training mode: batch-norm uses the batch's statistics) captures, for every Conv2d and
Linear layer, its weight, its input activation and the gradient of the loss with respect to its
output.

Each captured tensor is laid out as a matrix whose last dimension is the one blocks run along:
weights (out, in, kh, kw) as (out, in*kh*kw) (the forward product's reduction dimension, torch's
order), activations (N, C, H, W) and gradients (N, C, H, W) as (N*H*W, C) (the channel dimension
last), 2-D tensors of Linear layers as they are. The matrix is quantised (round to nearest) into
each format, and

    SQNR = 10 log10(sum(x**2) / sum((q - x)**2))   dB, in float64,

x the float32 tensor and q its quantised value. With the transform, q is
RandomHadamard(size).inverse(quantize(RandomHadamard(size).apply(x))), the transform along the
block dimension with size the format's block (32 for MX, 16 for NVFP4, 128 for the 1x128 and
128x128 FP8 formats; none for per-row and per-tensor scales), on layers whose block dimension is
a multiple of the size.

    python -m experiments.scaled_sqnr            # writes docs/results/scaled_sqnr.{md,png}
    python -m experiments.scaled_sqnr --out DIR  # writes DIR/scaled_sqnr.{md,png} instead

About 70 s on an idle 2-core machine with one thread (--threads 1, the default), 100 s beside
another job; about 1 GB of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import time
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import lpsim  # noqa: E402
from lpsim import demo  # noqa: E402
from lpsim.recipes import RECIPES  # noqa: E402
from lpsim.scaled import POWER_OF_TWO_RULES, SCALED_PRESETS, PowerOfTwo, Scaled  # noqa: E402
from lpsim.transforms import MAX_SIZE, RandomHadamard  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MODELS = ("digits", "resnet18")
MODEL_TITLES = {
    "digits": "demo CNN on digits",
    "resnet18": "resnet18 on Student-t noise",
}
KINDS = ("weight", "activation", "gradient")
KIND_TITLES = {"weight": "weights", "activation": "activations", "gradient": "gradients"}
PLOT_LIMIT_DB = 65.0  # the SQNR panels' right edge: above bfloat16's 56 dB
# What the default run's tables show (written from them; report() prints it for that run only).
OBSERVATIONS = """
Scale rules: with E4M3 elements floor loses 0.2 to 1.6 dB to ceil and rceil (mxfp8_e4m3: 29.9-31.9
against 31.5-32.1 dB), with E5M2 and E3M2 elements up to 0.3 dB, since it lets blocks whose largest
value lies above the element's top value saturate; with E2M3, E2M1 and integer elements ceil is the
worst rule, leaving the top binade unused (mxint8 loses 5.2 to 6.1 dB to floor, about one bit,
mxfp6_e2m3 1.3 to 2.1 dB, mxfp4_e2m1 0.7 to 1.8 dB). Even is the best rule for E2M3, E2M1 and
integers (to 0.05 dB), but lies 0.1 to 0.7 dB below ceil and rceil on E4M3, whose top binade ends at
448 = 1.75 * 2**8, so that blocks still clip; rceil is within 0.6 dB of the best rule for every
element and tensor. NVFP4 gains 1.7 to 3.6 dB over mxfp4_e2m1 with OCP's floor rule (1.4 to 2.9 dB
over its best rule, even), most on gradients, and stays 9 to 10.6 dB below mxfp6_e2m3. The
Hadamard transform moves weights by at most 0.5 dB (resnet18's near-Gaussian weights by less than
0.05 dB), mostly costs activations (down to -1.5 dB, +0.1 at best), and helps gradients under the
MX presets (+0.5 to +2.8 dB for mxint8, whose elements have no exponent of their own; -0.4 to +1.1
dB for the others) but costs NVFP4's gradients 1.0 to 1.3 dB, as docs/transforms.md found on
synthetic outliers. Unscaled e4m3fn matches the scaled FP8 formats on weights and activations
(31.3 to 31.5 dB) but gets 1.2 and 2.3 dB on gradients, most of whose elements round to zero; one
float32 scale per tensor brings them to 31.6-32.4 dB, within 1.6 dB of per-row and 1x128 scales.
E5M2 and E3M2 elements give the same SQNR to 0.1 dB: both have two fraction bits, and E3M2's
narrower range only touches elements more than 64 times smaller than their block's largest, which
carry little of the energy.
"""
# Elementwise formats without a scale, for comparison: what the shared scale buys.
BASELINES = {
    "e4m3fn, no scale": lpsim.preset("e4m3fn_saturating"),
    "bfloat16, no scale": lpsim.Float(8, 7),
}


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One row of the table: a format and the size of its Hadamard transform (None: n/a)."""

    label: str
    fmt: object
    hadamard_size: int | None


def hadamard_size(fmt) -> int | None:
    """The transform's size for a format: its block along the last axis when that is a power of
    two RandomHadamard supports; None for elementwise, per-row and per-tensor formats."""
    if not isinstance(fmt, Scaled):
        return None
    block = fmt.block[1] if isinstance(fmt.block, tuple) else fmt.block
    if not isinstance(block, int) or block < 2 or block & (block - 1):
        return None
    return block if block <= MAX_SIZE else None


def configurations(presets: list[str], rules: list[str]) -> list[Configuration]:
    """The scaled presets (every power-of-two preset under each rule in ``rules``), then the
    elementwise baselines."""
    rows = []
    for name in presets:
        fmt = SCALED_PRESETS[name]
        if fmt.axis != -1:
            raise ValueError(f"preset {name!r} blocks along axis {fmt.axis}; the layout needs -1")
        if isinstance(fmt.scale, PowerOfTwo):
            for rule in rules:
                ruled = dataclasses.replace(fmt, scale_rule=rule)
                rows.append(Configuration(f"{name}, {rule}", ruled, hadamard_size(ruled)))
        else:
            rows.append(Configuration(f"{name}, {fmt.scale_rule}", fmt, hadamard_size(fmt)))
    rows += [Configuration(label, fmt, None) for label, fmt in BASELINES.items()]
    return rows


# ---- Models and captured tensors


def student_t(shape: tuple, df: int, generator: torch.Generator) -> torch.Tensor:
    """Samples of Student's t with ``df`` (an integer) degrees of freedom: a standard normal over
    the square root of an independent chi-square (the sum of df squared normals) divided by df."""
    normal = torch.randn(shape, generator=generator)
    chi_square = torch.randn((df, *shape), generator=generator).square().sum(0)
    return normal / (chi_square / df).sqrt()


class KeepModel:
    """Stands in for a recipe in lpsim.demo.train and keeps the model the demo builds."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.name = recipe.name
        self.loss_scale = recipe.loss_scale
        self.model = None

    def apply(self, model, optimizer):
        model, optimizer = self.recipe.apply(model, optimizer)
        self.model = model
        return model, optimizer


def trained_digits_cnn(args) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The demo's CNN trained in float32 by lpsim.demo.train, and a batch of test images and
    labels to capture the tensors on."""
    data = demo.digits(args.seed)
    keeper = KeepModel(RECIPES["fp32"])
    curve, seconds = demo.train(keeper, data, args.digits_epochs, args.seed, progress=False)
    print(
        f"digits CNN: {args.digits_epochs} epochs in float32, test accuracy "
        f"{100 * curve[-1]:.1f}% ({seconds:.1f} s)",
        flush=True,
    )
    test_x, test_y = data[2], data[3]
    return keeper.model, test_x[: args.batch], test_y[: args.batch]


def trained_resnet18(args) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """torchvision's resnet18 (10 classes) after ``args.resnet_steps`` SGD steps on Student-t
    images with random labels, and a fresh batch of the same kind to capture the tensors on."""
    import torchvision  # noqa: PLC0415 - only this model needs it

    torch.manual_seed(args.seed)
    model = torchvision.models.resnet18(num_classes=10)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() > 1}
    optimizer = torch.optim.SGD(model.parameters(), lr=args.resnet_lr, momentum=0.9)
    data = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, 3, args.image_size, args.image_size)
    started = time.time()
    model.train()
    for step in range(1, args.resnet_steps + 1):
        x = student_t(shape, args.df, data)
        y = torch.randint(10, (args.batch,), generator=data)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.resnet_steps:
            print(
                f"resnet18: step {step}/{args.resnet_steps}, loss {loss.item():.3f} "
                f"({time.time() - started:.0f} s)",
                flush=True,
            )
    moved = [
        ((p.detach() - initial[n]).norm() / initial[n].norm()).item()
        for n, p in model.named_parameters()
        if n in initial
    ]
    print(
        f"resnet18: weights moved by {100 * statistics.median(moved):.1f}% of their initial norm "
        f"(median over layers; largest {100 * max(moved):.1f}%)",
        flush=True,
    )
    x = student_t(shape, args.df, data)
    y = torch.randint(10, (args.batch,), generator=data)
    return model, x, y


def capture(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, dict[str, torch.Tensor]]:
    """{kind: {layer name: tensor}} for every Conv2d and Linear layer after one forward and
    backward pass of the cross-entropy loss on (x, y) in training mode: the layer's weight, its
    input and the gradient of the loss with respect to its output, detached float32 copies, each
    kind's layers in the model's order."""
    captured = {kind: {} for kind in KINDS}
    handles = []

    def keep_input(name):
        def hook(module, inputs, output):
            captured["activation"][name] = inputs[0].detach().clone()

        return hook

    def keep_gradient(name):
        def hook(module, grad_inputs, grad_outputs):
            captured["gradient"][name] = grad_outputs[0].detach().clone()

        return hook

    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Conv2d, nn.Linear))
    ]
    for name, module in layers:
        captured["weight"][name] = module.weight.detach().clone()
        handles.append(module.register_forward_hook(keep_input(name)))
        handles.append(module.register_full_backward_hook(keep_gradient(name)))
    model.train()
    model.zero_grad()
    with warnings.catch_warnings():
        # The first layer's input needs no gradient; its hook still sees the output's gradient.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        nn.functional.cross_entropy(model(x), y).backward()
    for handle in handles:
        handle.remove()
    # The backward hooks fired from the last layer to the first: list the gradients in the
    # model's layer order, as the weights and activations.
    gradients = captured["gradient"]
    captured["gradient"] = {name: gradients[name] for name, _ in layers if name in gradients}
    return captured


def as_matrix(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a matrix whose last dimension is the one blocks run along: weights
    (out, in, kh, kw) -> (out, in*kh*kw); activations and gradients (N, C, H, W) -> (N*H*W, C);
    2-D tensors as they are."""
    if tensor.dim() == 2:
        return tensor.contiguous()
    if kind == "weight":
        return tensor.reshape(tensor.shape[0], -1)
    return tensor.movedim(1, -1).reshape(-1, tensor.shape[1])


# ---- SQNR


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float | None:
    """10 log10(sum(x**2) / sum((q - x)**2)) in dB, computed in float64: inf where q equals x,
    None where x is all zero (no signal)."""
    x, q = x.double(), q.double()
    signal = x.square().sum().item()
    noise = (q - x).square().sum().item()
    if signal == 0:
        return None
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise)


def measure(matrix: torch.Tensor, row: Configuration, hadamard_seed: int) -> tuple:
    """(SQNR without the transform, SQNR with it or None where it does not apply), in dB."""
    plain = sqnr_db(matrix, lpsim.quantize(matrix, row.fmt))
    size = row.hadamard_size
    if size is None or matrix.shape[-1] % size:
        return plain, None
    transform = RandomHadamard(size, axis=-1, seed=hadamard_seed)
    rotated = transform.inverse(lpsim.quantize(transform.apply(matrix), row.fmt))
    return plain, sqnr_db(matrix, rotated)


def gain_db(plain: float, rotated: float) -> float:
    """rotated - plain in dB (0 where both are exact)."""
    return 0.0 if plain == rotated else rotated - plain


def summary(per_layer: list[tuple]) -> dict:
    """Median and range over layers of the plain SQNR, and the median over the layers where the
    transform applies of its gain (dB), with the number of such layers."""
    plain = [p for p, _ in per_layer if p is not None]
    gains = [gain_db(p, h) for p, h in per_layer if p is not None and h is not None]
    return {
        "median": statistics.median(plain) if plain else None,
        "min": min(plain) if plain else None,
        "max": max(plain) if plain else None,
        "gain": statistics.median(gains) if gains else None,
        "transformed": len(gains),
        "layers": len(plain),
    }


# ---- Report


def cell(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def model_table(summaries: dict, rows: list[Configuration]) -> list[str]:
    header = ["format, scale rule"]
    for kind in KINDS:
        header += [KIND_TITLES[kind], "+H"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (2 * len(KINDS))]
    for row in rows:
        cells = [row.label]
        for kind in KINDS:
            s = summaries[kind][row.label]
            cells += [cell(s["median"]), cell(s["gain"], signed=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def coverage(summaries: dict, rows: list[Configuration]) -> str:
    """Which layers the transform applied to, per transform size and kind."""
    parts = []
    for size in sorted({r.hadamard_size for r in rows if r.hadamard_size is not None}):
        row = next(r for r in rows if r.hadamard_size == size)
        counts = ", ".join(
            f"{KIND_TITLES[kind]} {summaries[kind][row.label]['transformed']}/"
            f"{summaries[kind][row.label]['layers']}"
            for kind in KINDS
        )
        parts.append(f"size {size}: {counts}")
    return "; ".join(parts) if parts else "none"


def shapes_line(captured: dict) -> str:
    widths = {kind: [m.shape[-1] for m in captured[kind].values()] for kind in KINDS}
    return "; ".join(
        f"{KIND_TITLES[kind]} {', '.join(str(w) for w in widths[kind])}" for kind in KINDS
    )


def plot(summaries: dict, rows: list[Configuration], path: pathlib.Path) -> None:
    """Two panels per model: the SQNR (median, and a line from the smallest to the largest over
    layers) and the transform's gain, both in dB, per row of the table."""
    models = list(summaries)
    fig, axes = plt.subplots(
        2,
        len(models),
        figsize=(7.5 * len(models), 0.26 * len(rows) * 2 + 2.5),
        sharey=True,
        squeeze=False,
    )
    markers = {"weight": "o", "activation": "s", "gradient": "^"}
    colors = {"weight": "tab:blue", "activation": "tab:orange", "gradient": "tab:green"}
    offsets = {"weight": -0.22, "activation": 0.0, "gradient": 0.22}
    for column, model in enumerate(models):
        top, bottom = axes[0][column], axes[1][column]
        for kind in KINDS:
            for y, row in enumerate(rows):
                s = summaries[model][kind][row.label]
                yk = y + offsets[kind]
                if s["median"] is not None:
                    high = min(s["max"], PLOT_LIMIT_DB)  # an exact layer (inf) runs off the edge
                    top.plot([s["min"], high], [yk, yk], color=colors[kind], linewidth=0.8)
                    top.plot(min(s["median"], PLOT_LIMIT_DB), yk, markers[kind], color=colors[kind])
                if s["gain"] is not None and math.isfinite(s["gain"]):
                    bottom.plot(s["gain"], yk, markers[kind], color=colors[kind])
            top.plot([], [], markers[kind], color=colors[kind], label=KIND_TITLES[kind])
        top.set_title(f"{MODEL_TITLES[model]}: SQNR (median; line: min to max over layers)")
        bottom.set_title(f"{MODEL_TITLES[model]}: gain from the Hadamard transform (+H)")
        top.set_xlabel("SQNR (dB)")
        top.set_xlim(right=PLOT_LIMIT_DB)
        bottom.set_xlabel("SQNR with the transform - without (dB), median over layers")
        bottom.axvline(0, color="grey", linewidth=0.8)
        for ax in (top, bottom):
            ax.grid(axis="x", alpha=0.3)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels([r.label for r in rows], fontsize=8)
        top.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)  # the first row on top (shared by every panel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def exact_line(exact: dict, rows: list[Configuration]) -> str:
    """Which tensors some format quantised exactly (SQNR inf), per model."""
    parts = [
        f"{MODEL_TITLES[model]}, {KIND_TITLES[kind]} of layer `{layer}`, under {len(labels)} of "
        f"{len(rows)} rows: {'; '.join(labels)}"
        for model, tensors in exact.items()
        for (kind, layer), labels in tensors.items()
    ]
    return ". ".join(parts) if parts else "none"


def report(
    summaries: dict, shapes: dict, exact: dict, rows: list[Configuration], seconds: float, args
) -> str:
    threads = torch.get_num_threads()
    models = {
        "digits": f"lpsim.demo's small CNN trained in float32 on scikit-learn's digits for "
        f"{args.digits_epochs} epochs by the demo's own loop (lpsim.demo.train: SGD, batch 64); "
        f"tensors captured on {args.batch} test images; its first layer, `0`, reads the 8x8 "
        "images (one channel, multiples of 1/16)",
        "resnet18": f"torchvision's resnet18 (10 classes) after {args.resnet_steps} SGD steps "
        f"(lr {args.resnet_lr}, momentum 0.9, batch {args.batch}) on "
        f"{args.image_size}x{args.image_size} RGB inputs drawn from Student's t with {args.df} "
        f"degrees of freedom, with random labels; tensors captured on a fresh batch of "
        f"{args.batch} such inputs",
    }
    lines = [
        "# SQNR of scaled formats on a trained model's weights, activations and gradients",
        "",
        f"Written by `python -m experiments.scaled_sqnr` ({seconds:.0f} s on this machine, "
        f"{threads} thread{'s' if threads > 1 else ''}, seed {args.seed}, torch "
        f"{torch.__version__}). See experiments/README.md for the command and its options. The "
        "models are trained by torch's float32 kernels, whose bits can differ between torch "
        "builds and CPUs: another machine can train other models and give other tables.",
        "",
        "The quantisation error of every scaled preset of `lpsim.scaled` (and two unscaled "
        "formats for comparison) on the weights, activations and gradients of two small trained "
        "models, as the signal-to-quantisation-noise ratio:",
        "",
        "    SQNR = 10 log10(sum(x^2) / sum((q - x)^2))   in dB,",
        "",
        "x a float32 tensor, q its value after `lpsim.quantize(x, fmt)` (round to nearest, float32 "
        "container), the sums in float64. Higher is better; one bit more precision is about "
        "6 dB.",
        "",
        *[f"- {MODEL_TITLES[m]}: {models[m]}." for m in summaries],
        "- Tensors: after training, one forward and backward pass of the cross-entropy loss "
        "(training mode, so batch-norm uses the batch's statistics) captures for every Conv2d and "
        "Linear layer its weight, its input activation and the gradient of the loss with respect "
        "to its output.",
        "- Layout: blocks run along the last dimension of a matrix. Weights (out, in, kh, kw) "
        "become (out, in\\*kh\\*kw): blocks along the forward product's reduction dimension, in "
        "torch's (in, kh, kw) order. Activations and gradients (N, C, H, W) become "
        "(N\\*H\\*W, C): blocks along the channels, the reduction dimension of the next "
        "convolution (activations) and of the input-gradient product (gradients; the "
        "weight-gradient product reduces over N\\*H\\*W instead). Linear layers' 2-D tensors "
        "stay as they are. A dimension shorter than the block is one short block. The 128x128 "
        "tiles cover the matrix's last two dimensions. Block-dimension lengths, layer by layer: "
        + "; ".join(f"{MODEL_TITLES[m]}: {shapes[m]}" for m in summaries)
        + ".",
        "- Formats: the MX presets (E8M0 scales) under each power-of-two scale rule (floor is "
        "OCP's and the presets' default), the float-scaled presets with their amax rule, and "
        "e4m3fn (saturating) and bfloat16 rounding each element with no scale.",
        "- Aggregate: each cell is the median over a model's layers (the plot also shows the "
        "smallest and largest). A tensor quantised exactly has SQNR inf and counts as larger "
        "than any other in the median; an all-zero tensor (no signal) would be left out. Tensors "
        f"quantised exactly: {exact_line(exact, rows)}.",
        "- +H: the gain from a random Hadamard transform (`lpsim.RandomHadamard`, seed "
        f"{args.hadamard_seed}) of the block's size along the block dimension, applied before "
        "quantising and inverted after: the median, over the layers where it applies, of the "
        "layer's SQNR with the transform minus its SQNR without (dB; positive: the transform "
        "helps). It applies where the block is a power of two (32 for MX, 16 for NVFP4, 128 for "
        "the 1x128 and 128x128 FP8 presets) and the layer's block dimension is a multiple of it; "
        "per-row, per-tensor and unscaled formats: n/a.",
        "",
    ]
    for model in summaries:
        lines += [
            f"## {MODEL_TITLES[model]}",
            "",
            f"SQNR in dB, median over {summaries[model]['weight'][rows[0].label]['layers']} "
            f"layers; +H: the transform's gain in dB. Layers the transform applies to: "
            f"{coverage(summaries[model], rows)}.",
            "",
            *model_table(summaries[model], rows),
            "",
        ]
    lines += ["![SQNR per format](scaled_sqnr.png)", "", "## Observations", ""]
    if is_default_run(args):
        lines += [" ".join(OBSERVATIONS.split()), ""]
    else:
        lines += [
            "The observations are written for the default settings (`python -m "
            "experiments.scaled_sqnr` with no option but --out); this run changed some.",
            "",
        ]
    return "\n".join(lines)


# ---- Command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.scaled_sqnr", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}"
    )
    p.add_argument(
        "--presets",
        default=",".join(SCALED_PRESETS),
        help="comma-separated scaled presets (default: all of lpsim.scaled.SCALED_PRESETS)",
    )
    p.add_argument(
        "--rules",
        default=",".join(POWER_OF_TWO_RULES),
        help="comma-separated scale rules for the power-of-two (MX) presets "
        f"(default: {','.join(POWER_OF_TWO_RULES)})",
    )
    p.add_argument("--digits-epochs", type=int, default=5, help="demo CNN training epochs")
    p.add_argument("--resnet-steps", type=int, default=40, help="resnet18 SGD steps")
    p.add_argument("--resnet-lr", type=float, default=0.01, help="resnet18 learning rate")
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="resnet18's training batch, and the batch both models' tensors are captured on",
    )
    p.add_argument("--image-size", type=int, default=32, help="resnet18 input height and width")
    p.add_argument("--df", type=int, default=3, help="Student-t degrees of freedom (resnet18)")
    p.add_argument("--seed", type=int, default=0, help="seed of models, data and batches")
    p.add_argument("--hadamard-seed", type=int, default=0, help="seed of the transform's signs")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: results are bitwise reproducible for a given thread count)",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=RESULTS,
        metavar="DIR",
        help="directory for scaled_sqnr.md and scaled_sqnr.png (default: docs/results, where "
        "the committed results are regenerated; give another for trial runs)",
    )
    return p


def names(p: argparse.ArgumentParser, option: str, value: str, allowed) -> list[str]:
    """The comma-separated names of ``value``, each checked against ``allowed``."""
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    if not chosen:
        p.error(f"{option} names nothing; choose from {', '.join(allowed)}")
    for name in chosen:
        if name not in allowed:
            p.error(f"{option}: unknown name {name!r}; choose from {', '.join(allowed)}")
    return chosen


def is_default_run(args: argparse.Namespace) -> bool:
    """Whether args are the defaults (--out aside): the settings OBSERVATIONS describes."""
    defaults = vars(parse([]))
    return all(value == defaults[key] for key, value in vars(args).items() if key != "out")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.models = names(p, "--models", args.models, MODELS)
    args.presets = names(p, "--presets", args.presets, SCALED_PRESETS)
    args.rules = names(p, "--rules", args.rules, POWER_OF_TWO_RULES)
    for option, least in (
        ("digits_epochs", 1),
        ("resnet_steps", 0),
        ("batch", 2),
        ("image_size", 8),
        ("df", 1),
        ("threads", 1),
    ):
        if getattr(args, option) < least:
            p.error(
                f"--{option.replace('_', '-')} must be at least {least}, "
                f"got {getattr(args, option)}"
            )
    if not (args.resnet_lr > 0 and math.isfinite(args.resnet_lr)):
        p.error(f"--resnet-lr must be a finite positive number, got {args.resnet_lr}")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if not 0 <= args.hadamard_seed < 2**64:
        p.error(f"--hadamard-seed must be in [0, 2**64), got {args.hadamard_seed}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process keeps its setting


def run(args: argparse.Namespace) -> None:
    """The experiment for parsed arguments: prints its progress, writes the table and plot."""
    start = time.time()
    rows = configurations(args.presets, args.rules)
    build = {"digits": trained_digits_cnn, "resnet18": trained_resnet18}
    summaries, shapes, exact = {}, {}, {}
    for model_name in args.models:
        model, x, y = build[model_name](args)
        captured = capture(model, x, y)
        matrices = {
            kind: {layer: as_matrix(kind, t) for layer, t in captured[kind].items()}
            for kind in KINDS
        }
        shapes[model_name] = shapes_line(matrices)
        print(
            f"{model_name}: captured {len(matrices['weight'])} layers; block dimension "
            f"lengths: {shapes[model_name]}",
            flush=True,
        )
        summaries[model_name] = {kind: {} for kind in KINDS}
        exact[model_name] = {}
        for k, row in enumerate(rows, 1):
            for kind in KINDS:
                per_layer = {
                    layer: measure(m, row, args.hadamard_seed)
                    for layer, m in matrices[kind].items()
                }
                summaries[model_name][kind][row.label] = summary(list(per_layer.values()))
                for layer, (plain, _) in per_layer.items():
                    if plain == math.inf:
                        exact[model_name].setdefault((kind, layer), []).append(row.label)
            line = "  ".join(
                f"{kind[0].upper()} {cell(summaries[model_name][kind][row.label]['median'])}"
                f" ({cell(summaries[model_name][kind][row.label]['gain'], signed=True)})"
                for kind in KINDS
            )
            print(
                f"{model_name} [{k}/{len(rows)}] {row.label:26s} SQNR dB (+H gain): {line} "
                f"({time.time() - start:.0f} s)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(summaries, rows, args.out / "scaled_sqnr.png")
    text = report(summaries, shapes, exact, rows, time.time() - start, args)
    (args.out / "scaled_sqnr.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

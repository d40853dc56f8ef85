"""The CIFAR10 recipes of the QPyTorch paper (Zhang, Yang, De Sa, "QPyTorch: A Low-Precision
Arithmetic Simulation Framework", 2019) and of QPyTorch's examples, written with lpsim.

A recipe names a model, where quantisers go in it, the formats and rounding of the five quantised
categories (weights, activations, errors, gradients, momentum; plus a weight accumulator for
IBM8), the optimiser and its learning-rate schedule, the loss, and (SWALP) weight averaging.
``recipe.prepare(model, lr)`` applies it to a freshly built model on its device and returns the
model and optimiser to train; ``recipe.lr_factor(epoch, epochs, swa_start)`` is the schedule.

Every schedule is written relative to the number of epochs; at a recipe's default epochs it is the
schedule of its QPyTorch example. Each recipe's ``source`` names the example it
follows, and its ``deviations`` say where and why it differs from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn.utils import parametrize

import lpsim
from lpsim import BlockFloat, Fixed, Float
from lpsim.nn import LayerQuantization, quantizer
from lpsim.optim import OptimLP
from lpsim.recipes import BLOCK8 as LPSIM_BLOCK8
from lpsim.recipes import IBM8 as LPSIM_IBM8
from lpsim.recipes import Recipe

__all__ = [
    "CifarRecipe",
    "WageRecipe",
    "RECIPES",
    "wilson_factor",
    "after_relus",
    "after_weight_layers_but_last",
    "ibm8_placement",
    "wage_shift",
    "wage_init_",
    "WageWeight",
    "WageGradient",
    "wage_clip",
    "describe",
]

WEIGHT_LAYERS = (nn.Conv2d, nn.Linear)


# Learning-rate schedules


def wilson_factor(epoch: int, budget: int) -> float:
    """The schedule of QPyTorch's examples (from the SWA code base): 1 for the first half of
    ``budget`` epochs, then linear down to 0.01 at 90%, then 0.01."""
    t = epoch / budget
    if t <= 0.5:
        return 1.0
    if t <= 0.9:
        return 1.0 - 0.99 * (t - 0.5) / 0.4
    return 0.01


def _wage_factor(epoch: int, epochs: int) -> float:
    """WAGE's steps: the initial rate for the first two thirds, 1/8 of it to five sixths, then 1/64
    (8, 1, 1/8 at epochs 0, 200, 250 of 300 in QPyTorch's example)."""
    if 3 * epoch < 2 * epochs:
        return 1.0
    if 6 * epoch < 5 * epochs:
        return 1.0 / 8
    return 1.0 / 64


# Where the quantisers go (inject() configurations)


def after_relus(model: nn.Module, q: Recipe) -> dict:
    """Activations and errors at the output of every ReLU (QPyTorch's VGG16LP model, and
    lower(model, layer_types=["activation"]))."""
    return {nn.ReLU: LayerQuantization(output=q.activation, error=q.error)}


def _weight_layer_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)]


def after_weight_layers_but_last(model: nn.Module, q: Recipe) -> dict:
    """Activations and errors at the output of every convolution and linear layer except the last
    one (QPyTorch's sequential_lower(layer_types=["conv", "linear"]) with the final quantiser
    removed, as in examples/SWALP)."""
    return {
        _weight_layer_names(model)[-1]: None,
        WEIGHT_LAYERS: LayerQuantization(output=q.activation, error=q.error),
    }


IBM8_EDGE = (Float(6, 9), "nearest")  # the 16-bit format at the network's input and output


def ibm8_placement(model: nn.Module, q: Recipe) -> dict:
    """QPyTorch's PreResNet20LP: the input image and the logits (and the logits' error) in e6m9
    with round-to-nearest; e5m2 at the output of the first convolution, of every convolution in
    the residual branches and of every ReLU; shortcut convolutions and additions unquantised."""
    names = _weight_layer_names(model)
    low = LayerQuantization(output=q.activation, error=q.error)
    return {
        names[-1]: LayerQuantization(output=IBM8_EDGE, error=IBM8_EDGE),
        names[0]: LayerQuantization(input=IBM8_EDGE, output=q.activation, error=q.error),
        lambda name, m: isinstance(m, nn.Conv2d) and "downsample" not in name: low,
        nn.ReLU: low,
    }


# The recipe


def _as_in_training(value):
    """An inject() entry whose stochastic rules stay stochastic in eval mode."""
    if isinstance(value, LayerQuantization):
        return replace(value, eval_rounding=None)
    return value


@dataclass(frozen=True)
class CifarRecipe:
    """A CIFAR10 training recipe.

    Attributes:
        name: the name given to --recipe.
        summary: one line for the listing.
        model: a key of models.MODELS; model_options go to its constructor.
        epochs, batch_size, lr, momentum, weight_decay: SGD's settings and the training length
            (batch_size is the global batch, summed over processes).
        schedule: "wilson" (wilson_factor over the epochs, or over the epochs before SWA) or
            "wage" (three steps).
        loss: "cross_entropy" (mean over the batch) or "sse" (WAGE's half sum of squared errors
            against one-hot targets, summed over the batch).
        inputs: "normalize" (per-channel mean and standard deviation) or "symmetric" (2x - 1, from
            [0, 1] to [-1, 1]).
        quantization: formats and rounding of the categories (an lpsim Recipe), or None.
        placement: builds the inject() configuration from the model and ``quantization``.
        swa_start: fraction of the epochs after which weights are averaged (None: no averaging);
            swa_lr: the constant learning rate from then on.
        source: the QPyTorch example (path in the Tiiiger/QPyTorch repository) it follows.
        deviations: where and why it departs from that example.
        multi_process: what a run in several processes (torchrun) does otherwise than the
            recipe's one process. Every process draws the same random numbers (its stochastic
            rounding must round the weights as the others do), so their shares of the batch get
            the same dropout masks and stochastic-rounding draws, where one process draws anew
            for every image; and whatever is computed over the batch (a shared exponent, WAGE's
            shift, batch-norm statistics) spans one process's share.
    """

    name: str
    summary: str
    model: str
    epochs: int
    lr: float
    source: str
    model_options: tuple = ()
    batch_size: int = 128
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "wilson"
    loss: str = "cross_entropy"
    inputs: str = "normalize"
    quantization: Recipe | None = None
    placement: Callable[[nn.Module, Recipe], dict] | None = None
    swa_start: float | None = None
    swa_lr: float | None = None
    deviations: tuple[str, ...] = field(default=())
    multi_process: str = ""

    @property
    def loss_scale(self) -> float:
        return self.quantization.loss_scale if self.quantization is not None else 1.0

    def default_swa_start(self, epochs: int) -> int | None:
        """The epoch (from 0) from which weights are averaged in a run of ``epochs`` epochs: the
        recipe's fraction of them, kept between 1 and epochs - 1 so that at least one epoch
        trains before averaging and one is averaged (None for recipes without averaging).

        Raises:
            ValueError: epochs < 2, too few for both.
        """
        if self.swa_start is None:
            return None
        if epochs < 2:
            raise ValueError(
                f"recipe {self.name} trains at least one epoch before averaging and "
                f"averages at least one: it needs 2 or more epochs, got {epochs}"
            )
        return min(max(int(epochs * self.swa_start), 1), epochs - 1)

    def lr_factor(self, epoch: int, epochs: int, swa_start: int | None, lr: float) -> float:
        """The learning rate of ``epoch`` (from 0) as a multiple of the initial rate ``lr``."""
        if self.schedule == "wage":
            return _wage_factor(epoch, epochs)
        if swa_start is not None:
            return wilson_factor(epoch, swa_start) if epoch < swa_start else self.swa_lr / lr
        return wilson_factor(epoch, epochs)

    def check_lr(self, lr: float) -> None:
        """Raise ValueError unless lr suits the recipe."""
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"the learning rate must be a positive number, got {lr!r}")

    def prepare(self, model: nn.Module, lr: float):
        """Apply the recipe to ``model`` (already on its device): build SGD, then let the lpsim
        Recipe inject the quantisers where ``placement`` says and wrap SGD in OptimLP rounding
        every parameter (as QPyTorch's examples do), and round the initial weights as OptimLP
        rounds them after every step (from the accumulator when there is one). Accumulators
        (IBM8's) start from the unrounded initial weights, as QPyTorch's OptimLP starts them
        (lpsim's OptimLP rounds them into ``acc`` when it is made). The model's
        quantisers round in eval mode as in training, stochastic ones stochastically, as
        QPyTorch's quantisers do when its examples evaluate (lpsim's default in eval mode is
        round-to-nearest). Returns (model, optimizer)."""
        self.check_lr(lr)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        q = self.quantization
        if q is None:
            return model, optimizer
        initial = {p: p.detach().clone() for p in model.parameters()} if q.acc else {}
        layers = {key: _as_in_training(value) for key, value in self.placement(model, q).items()}
        model, optimizer = q.apply(model, optimizer, layers=layers, parameters="all")
        with torch.no_grad():
            for p, accumulator in optimizer.accumulators.items():
                accumulator.copy_(initial[p])
        optimizer.round_weights()
        return model, optimizer

    def criterion(
        self, logits: torch.Tensor, labels: torch.Tensor, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to differentiate, its sum over the batch for logging), for one process's
        share of a global batch of world_size shares. The loss to differentiate gives the errors
        one process training on the whole batch computes for these images, bit for bit, for any
        world_size: the summed squared error's are per image, and the cross-entropy is divided by
        the whole batch's size, not the share's (the share's mean would give errors world_size
        times larger, rounded otherwise by the error formats where world_size is not a power of
        two). DistributedDataParallel must then sum the processes' gradients
        (experiments.runs.sum_gradients), not average them."""
        if self.loss == "sse":
            target = nn.functional.one_hot(labels, logits.shape[1]).to(logits.dtype)
            total = 0.5 * (logits - target).square().sum()
            return total, total.detach()
        if world_size == 1:
            mean = nn.functional.cross_entropy(logits, labels)
            return mean, mean.detach() * len(labels)
        total = nn.functional.cross_entropy(logits, labels, reduction="sum")
        return total / (len(labels) * world_size), total.detach()


# WAGE (Wu, Li, Chen, Shi, "Training and inference with integers in deep neural networks", ICLR
# 2018) as in QPyTorch's examples/WAGE: 2-bit weights, 8-bit activations, errors and gradients.

WAGE_BITS = {"weight": 2, "activation": 8, "error": 8, "gradient": 8}


def _symmetric_fixed(bits: int, *, clamp: bool = True) -> Fixed:
    """Fixed point in (-1, 1): bits-bit words with bits - 1 fractional bits, without the most
    negative code."""
    return Fixed(bits, bits - 1, clamp=clamp, symmetric=True)


def wage_shift(x: torch.Tensor) -> torch.Tensor:
    """x divided by the smallest power of two at or above max|x| (so max|x| lands in (1/2, 1]);
    an all-zero x is returned unchanged. WAGE's per-layer scaling of errors and gradients."""
    peak = x.detach().abs().amax()
    mantissa, exponent = torch.frexp(peak)  # peak = mantissa * 2**exponent, mantissa in [1/2, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # exact powers of two: 2**(e-1)
    scale = torch.where(
        peak > 0, torch.ldexp(torch.ones_like(peak), exponent), torch.ones_like(peak)
    )
    return x / scale


def wage_init_(weight: torch.Tensor, bits: int = WAGE_BITS["weight"]) -> float:
    """WAGE's initialisation, in place: uniform in [-L, L] with L = max(sqrt(3 / fan_in), Wm),
    Wm = 1.5 / 2**(bits-1); returns the layer's scale, the power of two nearest to
    Wm / sqrt(3 / fan_in) (at least 1), by which the quantised weight is divided."""
    fan_in = weight[0].numel()
    limit = math.sqrt(3.0 / fan_in)
    wm = 1.5 / 2 ** (bits - 1)
    scale = max(2.0 ** round(math.log2(wm / limit)), 1.0)
    with torch.no_grad():
        weight.uniform_(-max(wm, limit), max(wm, limit))
    return scale


class WageWeight(nn.Module):
    """Parametrisation: the weight seen by forward is the accumulator rounded to nearest into
    {-1/2, 0, 1/2} (2-bit symmetric fixed point), divided by the layer's scale; the gradient
    passes straight through to the accumulator."""

    def __init__(self, scale: float, bits: int = WAGE_BITS["weight"]):
        super().__init__()
        self.scale = scale
        self.format = _symmetric_fixed(bits)

    def forward(self, accumulator: torch.Tensor) -> torch.Tensor:
        return lpsim.quantize(accumulator, self.format, "nearest") / self.scale

    def extra_repr(self) -> str:
        return f"{self.format!r} nearest, / {self.scale:g}"


class WageGradient:
    """OptimLP's gradient function for WAGE: g -> Q(lr * shift(g) / 2**(bits-1)) / lr, Q rounding
    stochastically to multiples of 2**-(bits-1) without clamping. SGD with learning rate lr then
    subtracts Q(...) itself from the accumulator, as WAGE does. lr is read from the optimizer's
    first parameter group at every call (so the schedule, and a loaded state_dict, apply). Exact
    when lr is a power of two."""

    def __init__(self, optimizer: torch.optim.Optimizer, bits: int = WAGE_BITS["gradient"]):
        self.optimizer = optimizer
        self.bits = bits
        self.format = _symmetric_fixed(bits, clamp=False)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        lr = self.optimizer.param_groups[0]["lr"]
        step = lpsim.quantize(
            wage_shift(grad) * (lr / 2 ** (self.bits - 1)), self.format, "stochastic"
        )
        return step / lr

    def __repr__(self) -> str:
        return f"WageGradient({self.format!r} stochastic)"


def wage_clip(weight: torch.Tensor, bits: int = WAGE_BITS["weight"]) -> torch.Tensor:
    """The accumulator clipped to +/-(1 - 2**-(bits-1)), the range of the quantised weight."""
    limit = 1.0 - 2.0 ** (1 - bits)
    return weight.clamp(-limit, limit)


def _attach_output(module: nn.Module, fn) -> None:
    module.register_forward_hook(lambda mod, args, output: fn(output))


@dataclass(frozen=True)
class WageRecipe(CifarRecipe):
    """WAGE: its own initialisation, ternary weights with per-layer scales, fixed-point
    activations with a clip-masked straight-through gradient, shifted fixed-point errors, and
    plain SGD on an accumulator of shifted fixed-point gradients."""

    def check_lr(self, lr: float) -> None:
        super().check_lr(lr)
        if math.frexp(lr)[0] != 0.5:
            raise ValueError(
                f"WAGE's learning rate must be a power of two (its updates are multiples of "
                f"2**-{WAGE_BITS['gradient'] - 1}), got {lr!r}"
            )

    def prepare(self, model: nn.Module, lr: float):
        self.check_lr(lr)
        named = dict(model.named_parameters())
        layers = [m for m in model.modules() if isinstance(m, WEIGHT_LAYERS)]
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) or (
            len(named) != len(layers)
        ):
            raise ValueError(
                "WAGE applies to models whose only parameters are the weights of "
                "convolutions and linear layers (no biases, no batch norm), such as "
                "vgg7"
            )
        for layer in layers:
            scale = wage_init_(layer.weight)
            with torch.no_grad():
                layer.weight.copy_(wage_clip(layer.weight))
            parametrize.register_parametrization(layer, "weight", WageWeight(scale))
        act, err = (_symmetric_fixed(WAGE_BITS[k]) for k in ("activation", "error"))
        inner = quantizer(
            forward=(act, "nearest"),
            backward=(err, "stochastic"),
            clamp_grad_zero=True,
            backward_hooks=[wage_shift],
        )
        for m in model.modules():
            if isinstance(m, nn.ReLU):
                _attach_output(m, inner)
        first = quantizer(forward=(act, "nearest"))
        model.register_forward_pre_hook(lambda mod, args: tuple(first(a) for a in args))
        last = quantizer(backward=(err, "stochastic"), backward_hooks=[wage_shift])
        _attach_output(model, last)
        sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
        optimizer = OptimLP(sgd, grad=WageGradient(sgd), weight=wage_clip)
        return model, optimizer


# The recipes

_HALF = (Float(5, 10), "stochastic")
_BLOCK8_ROWS = (BlockFloat(8, dim=0), "stochastic")
_INITIAL_WEIGHTS = (
    "The initial weights are rounded into the weight format before the first "
    "step; QPyTorch's example rounds them only after it."
)
_SCHEDULE_TIMING = (
    "Epoch e trains at the schedule's value for e; QPyTorch's example steps its "
    "LambdaLR before each epoch, so its epoch e trains at the value for e + 1."
)

FP32 = CifarRecipe(
    "fp32",
    "VGG16 in float32 (the baseline)",
    model="vgg16",
    epochs=200,
    lr=0.05,
    source="examples/lp_train/train.py with VGG16 and no quantisation",
    multi_process="the processes' shares of the batch get the same dropout masks",
)

FP16 = CifarRecipe(
    "fp16",
    "VGG16, weights/activations/errors/gradients/momentum in e5m10, stochastic rounding",
    model="vgg16",
    epochs=200,
    lr=0.05,
    quantization=Recipe(
        "fp16", weight=_HALF, activation=_HALF, error=_HALF, grad=_HALF, momentum=_HALF
    ),
    placement=after_relus,
    source="examples/half_baseline/half_stochastic.sh (in QPyTorch's tree before February 2019)",
    deviations=(
        "e5m10 is IEEE half precision (max 65504, overflow to Inf, ties to even); QPyTorch's "
        "e5m10 treats the top exponent as finite and saturates.",
        "The example script asks for 11 mantissa bits; half precision stores 10, the paper's FP16.",
        _INITIAL_WEIGHTS,
    ),
    multi_process=(
        "the processes' shares of the batch get the same dropout masks and stochastic-rounding "
        "draws"
    ),
)

BLOCK8 = CifarRecipe(
    "block8",
    "VGG16, 8-bit block floating point (one exponent per tensor) everywhere, stochastic",
    model="vgg16",
    epochs=200,
    lr=0.05,
    quantization=LPSIM_BLOCK8,
    placement=after_relus,
    source="examples/lp_train/sample_scripts/block_baseline.sh",
    deviations=(_INITIAL_WEIGHTS,),
    multi_process=(
        "each process's share of the batch has one exponent per activation and error tensor, "
        "and the shares get the same dropout masks and stochastic-rounding draws"
    ),
)

WAGE = WageRecipe(
    "wage",
    "VGG7, 2-bit weights, 8-bit activations/errors/gradients (WAGE), SSE loss",
    model="vgg7",
    epochs=300,
    lr=8.0,
    momentum=0.0,
    weight_decay=0.0,
    schedule="wage",
    loss="sse",
    inputs="symmetric",
    source="examples/WAGE/reproduce.sh",
    deviations=(
        "Ternary weights round ties to even (as WAGE's TensorFlow code); QPyTorch's CUDA kernel "
        "rounds them away from zero.",
        "The accumulator is clipped after each update instead of before the next one, and once "
        "at initialisation: the weights seen by every forward pass are the same.",
    ),
    multi_process=(
        "each process's share of the batch has its own per-layer shift of the errors, and the "
        "shares get the same stochastic-rounding draws"
    ),
)

SWALP = CifarRecipe(
    "swalp",
    "VGG16, 8-bit block floating point per row everywhere, SWA from 2/3 of the epochs",
    model="vgg16",
    model_options=(("conv_init", "fan_in"),),
    epochs=300,
    lr=0.05,
    quantization=Recipe(
        "swalp",
        weight=_BLOCK8_ROWS,
        activation=_BLOCK8_ROWS,
        error=_BLOCK8_ROWS,
        grad=_BLOCK8_ROWS,
        momentum=_BLOCK8_ROWS,
    ),
    placement=after_weight_layers_but_last,
    swa_start=2 / 3,
    swa_lr=0.01,
    multi_process=(
        "the processes' shares of the batch get the same dropout masks and stochastic-rounding "
        "draws"
    ),
    source="examples/SWALP/example.sh (run with CIFAR10)",
    deviations=(
        _SCHEDULE_TIMING,
        _INITIAL_WEIGHTS,
        "Batch-norm statistics of the averaged model are recomputed on the training "
        "data (a no-op for this VGG16, which has none).",
        "The SWALP paper's own code (github.com/stevenygd/SWALP, exp/block_vgg_swa.sh) differs "
        "from the QPyTorch example followed here, and so from this recipe: it quantises "
        "activations and errors after every ReLU (VGG16LP) with one exponent per tensor (its "
        "BlockQuantizer ignores the small-block option), where the example quantises the "
        "outputs of the convolution and linear layers with one exponent per row; it gives "
        "each bias one exponent, where dim 0 gives every bias element its own; it initialises "
        "convolutions from N(0, 2/(9*out_channels)), the example from torch's fan-in He "
        "normal; it starts averaging one epoch earlier (after epoch swa_start - 1, whose rate "
        "is the last of the decay) and keeps an 8-bit block accumulator, the same format as "
        "its weights. The paper's CIFAR10 numbers (7.61 SGD-LP, 6.70 SWALP) come from that code.",
    ),
)

IBM8 = CifarRecipe(
    "ibm8",
    "PreResNet20, e5m2 nearest data, e6m9 stochastic accumulator/momentum, loss x1000",
    model="preresnet20",
    epochs=200,
    lr=0.05,
    quantization=LPSIM_IBM8,
    placement=ibm8_placement,
    source="examples/IBM8/example.sh",
    deviations=(
        "e5m2 here is IEEE-like with saturation at 57344; QPyTorch's e5m2 treats the top "
        "exponent as finite (max 114688).",
        "Round to nearest (e5m2 weights, activations, errors and gradients; e6m9 at the "
        "network's input and logits) ties to even here; QPyTorch's float quantiser rounds ties "
        "away from zero (it adds half a unit and truncates), so a value halfway between two "
        "e5m2 numbers (1.125, say) rounds down to 1 here and up to 1.25 there.",
        "e6m9 (momentum, accumulator, input and logits) is IEEE-like here: beyond its largest "
        "value 2^31 (2 - 2^-9), about 4.29e9, it overflows to Inf; QPyTorch's e6m9 treats the "
        "top exponent as finite (one more binade, to about 8.6e9) and saturates there.",
        _SCHEDULE_TIMING,
        _INITIAL_WEIGHTS,
        "Products are summed in float32, as in QPyTorch's example (its README says so): Wang et "
        "al. (NeurIPS 2018) accumulate the FP8 products of every GEMM in FP16 (1,6,9) with "
        "chunk-based accumulation, which is not simulated (lpsim.MAC can express a chunked "
        "e6m9 accumulator).",
        "The model and hyperparameters (PreResNet20, lr 0.05, 200 epochs, loss scale 1000) are "
        "the QPyTorch example's, which says they differ from the paper's, for want of a "
        "reference implementation.",
    ),
    multi_process="each process's batch norms normalise its own share of the batch",
)

RECIPES = {r.name: r for r in (FP32, FP16, BLOCK8, WAGE, SWALP, IBM8)}


def describe() -> str:
    """Per recipe: name, model, epochs, learning rate and summary, the QPyTorch example it
    follows, and where it departs from it."""
    lines = []
    for r in RECIPES.values():
        lines.append(f"{r.name:7s} {r.model:12s} {r.epochs:4d} epochs  lr {r.lr:<5g} {r.summary}")
        lines.append(f"        follows {r.source}")
        lines.extend(f"        differs: {d}" for d in r.deviations)
    return "\n".join(lines)

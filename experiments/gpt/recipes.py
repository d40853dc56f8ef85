"""The low-precision recipes the GPT trains under, each built from a fresh model.

``RECIPES[name].build(model, lr=..., weight_decay=..., betas=..., seed=...)`` injects the recipe's
quantisers into the model (lpsim.nn.inject, in place) and returns ``(model, optimizer,
functions)``: the optimizer to train with, and ``functions``, None or the config of
``lpsim.nn.quantize_functions`` for the two products inside attention (which inject cannot see):

    with lpsim.nn.quantize_functions(model, functions):
        logits = model(tokens)

What each recipe quantises ("operands" are the inputs of a product: for a Linear its input
activation and its weight, forward, and the error flowing back into its output, backward; blocks
of scaled formats run along the last axis, the Linear products' reduction axis for activations
(B, T, in) and weights (out, in)):

- ``fp32``: nothing; torch.optim.AdamW.
- ``bf16-nearest``, ``bf16-stochastic``: bfloat16 weights without a float32 master copy: every
  parameter (Linear, embeddings, LayerNorm) holds a bfloat16 value and lpsim.optim.AdamW rounds
  each updated weight once into bfloat16, to nearest (updates below half a spacing are lost) or
  stochastically (unbiased); its moments stay float32. Every Linear (the head included) takes
  bfloat16 inputs and rounds its output and its error to bfloat16 by round to nearest, as
  torch.autocast(bfloat16) computes them (bfloat16 operands, float32 accumulation, a bfloat16
  result); the results of its backward products, the gradients of its input and of its weight
  and bias, stay float32, where torch.autocast(bfloat16) rounds them to bfloat16 too.
  Embeddings, LayerNorm, GELU, residual additions, attention, softmax and the loss stay float32.
- ``fp8-current``: every Linear but the head (the head and the embeddings stay float32, the usual
  practice of FP8 recipes; the first Linear, block 0's qkv, is quantised, unlike lpsim.recipes'
  keep_edges): E4M3 inputs and weights with one float32 scale per tensor from the tensor's own
  amax (current scaling, SCALED_PRESETS "fp8_e4m3_tensor"), E5M2 errors likewise
  ("fp8_e5m2_tensor"), round to nearest; float32 master weights, gradients and AdamW state.
- ``fp8-delayed``: the same operands with Transformer Engine's delayed scaling
  (lpsim.delayed_scaling.DelayedScaling, amax history 16, reduction max, margin 0): each tensor's
  scale comes from the amaxes of its earlier quantisations, one DelayedScaler per tensor in the
  model's state_dict.
- ``mxfp8``: lpsim.recipes.MXFP8 with blocks along the last axis (Recipe.along(-1)) on every
  Linear but the head: E4M3 forward and E5M2 errors, E8M0 scale per 32, round to nearest; the
  backward products take the forward's quantised operands and the error quantised once (blocks
  along the output channels). Float32 master weights.
- ``mxfp4``: after Tseng et al., "Training LLMs with MXFP4" (2025), on every Linear but the head:
  E2M1 with an E8M0 scale per 32. Forward: inputs and weights rounded to nearest, blocks along
  in_features (the forward product's reduction). Backward (lpsim.nn.functional.Operands): every
  operand of both products is quantised afresh from the unquantised tensor, along that product's
  reduction axis, and rounded stochastically so that the products are unbiased: the input
  gradient's error (blocks along the output channels) and weight (along out_features); the weight
  gradient's error and input (along the tokens), both after a 16-point random Hadamard transform
  along the tokens (one fixed sign vector, seed 0). The stochastically rounded operands take
  round-up scales ("rceil": the block's largest magnitude at most 6 times its scale) where Tseng
  et al. multiply by 3/4: with OCP's floor scale the block's largest elements can exceed 6 and
  saturate under stochastic rounding, a bias. Float32 master weights.
- ``nvfp4``: after NVIDIA's "Pretraining Large Language Models with NVFP4" (2025), on every Linear
  but the head: E2M1 with an E4M3 scale per 16 and a float32 tensor scale. Inputs 1x16 blocks
  along in_features, weights 16x16 tiles (the same quantised weight serves the forward and the
  input-gradient products, as in NVIDIA's recipe), round to nearest. Backward: the error
  rounded stochastically, 1x16 blocks along the output channels for the input gradient; for the
  weight gradient the error (stochastically) and the unquantised input (to nearest) quantised
  afresh in 1x16 blocks along the tokens, after the 16-point random Hadamard transform. Float32
  master weights. Not simulated: NVIDIA keeps some layers (the last few blocks) in BF16.
- ``fp8-hopper``, ``fp8-hopper-promoted``: fp8-current, with every product of every quantised
  Linear (the forward product and both backward products) and both attention products summed by
  lpsim.mac.preset("H100/e4m3") (the H100's FP8 tensor core: each group of 32 exact products and
  the running sum aligned to their largest exponent, truncated to 13 fraction bits and normalised
  toward zero into a Float(8, 13) accumulator, never promoted) or preset("DeepSeek-V3") (the same
  chain, promoted into float32 every 128 products). The operands are the dequantised values (the
  FP8 code times its tensor's float32 scale), so each is aligned by its own exponent
  (``scaled_operands_mac``: the preset with ``operands=None``); the hardware multiplies the codes
  and applies the two scales after the sum, so where a scale is not a power of two the model's
  truncation points can differ from the hardware's by a bit, and the scales' own significand bits
  take part in the truncated products. The products run on the CPU only (lpsim.mac's
  tensor-core loop): these recipes need --device cpu.

Each recipe's ``deviations`` says where it departs from the published recipe it is named after:
mxfp8 reuses the forward's quantised operands in the backward products; mxfp4 quantises the
forward products too, which Tseng et al. keep in BF16; nvfp4 quantises the layers NVIDIA keeps in
BF16; fp8-hopper-promoted takes only DeepSeek-V3's accumulation, not its 1x128 and 128x128 E4M3
quantisation; and those three quantise attention's products, which Tseng et al., NVIDIA and
DeepSeek-V3 keep in BF16.

Attention (``functions``; fp32 and the bf16 recipes have none): every FP8 and scaled recipe rounds
the operands of both attention products into its forward element format and the errors flowing
into them into its error format (the FP4 recipes: the stochastically rounded error format of their
input-gradient products), with the same rounding rules as its Linear layers; the products
themselves are float32 and so is the softmax (as FP8 attention kernels compute it). The scores
product q k^T (``"attention.scores"``): ``input`` q, ``weight`` k^T, ``error`` the gradient of the
scores; the context product p v (``"attention.context"``): ``input`` the probabilities p,
``weight`` v, ``error`` the gradient of the context. lpsim.nn.quantize_functions passes the second
operand as the matrix it multiplies (k^T, (B, heads, head_dim, T), and v, (B, heads, T,
head_dim)), so both reduce along their axis -2 and the first operands along -1: scaled formats'
blocks run along those axes; errors along -1 (as the Linear layers' errors). fp8-delayed scales
the attention operands by delayed scaling too: quantize_functions keeps one amax history per call
site (block, product, operand), which the trainer saves in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.optim import Optimizer

import lpsim
from lpsim import MAC, Float
from lpsim.delayed_scaling import DelayedScaling
from lpsim.nn import LayerQuantization, inject
from lpsim.nn.functional import Operands
from lpsim.recipes import MXFP8, Recipe
from lpsim.scaled import Scaled, preset

__all__ = [
    "GPTRecipe",
    "RECIPES",
    "HADAMARD",
    "MXFP4_LINEAR",
    "NVFP4_LINEAR",
    "HEAD",
    "BFLOAT16",
    "parameter_groups",
    "attention_functions",
    "linear_layers",
    "describe",
]

HEAD = "head"  # the model's last Linear, kept in float32 by the FP8 and scaled recipes
BFLOAT16 = Float(8, 7)

_E4M3_TENSOR = (preset("fp8_e4m3_tensor"), "nearest")
_E5M2_TENSOR = (preset("fp8_e5m2_tensor"), "nearest")
_DELAYED = dict(history_length=16, reduction="max")
_E4M3_DELAYED = (DelayedScaling(preset("fp8_e4m3_tensor").element, **_DELAYED), "nearest")
_E5M2_DELAYED = (DelayedScaling(preset("fp8_e5m2_tensor").element, **_DELAYED), "nearest")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: weight decay on the matrices (Linear weights and embeddings,
    every parameter of two or more dimensions), none on biases and LayerNorm parameters (GPT-2's
    and nanoGPT's practice)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _along(spec, axis: int):
    """A (Scaled, rounding) spec with its blocks along ``axis``; other specs unchanged."""
    fmt, rounding = spec
    if isinstance(fmt, Scaled) and fmt.block != "tensor":
        fmt = replace(fmt, axis=axis)
    return fmt, rounding


def attention_functions(forward, error, mac: MAC | None = None) -> dict[str, LayerQuantization]:
    """The quantize_functions config of the two attention products: operands in ``forward``
    ((format, rounding); scaled blocks along each operand's reduction axis: -1 for q and p, -2 for
    k^T and v), the errors into the products in ``error`` (blocks along -1), and ``mac`` for their
    forward and backward products (None: torch's)."""
    first, second, errors = _along(forward, -1), _along(forward, -2), _along(error, -1)
    product = LayerQuantization(input=first, weight=second, error=errors, mac=mac)
    return {"attention.scores": product, "attention.context": product}


def linear_layers(recipe: Recipe) -> Callable[[nn.Module], dict]:
    """The inject() config maker of a Recipe with placement "operands" for the GPT: its
    Linear-operand quantisers (and its MAC, for the forward and both backward products) on every
    Linear but the head (which stays float32, as do the embeddings and LayerNorms)."""
    if recipe.placement != "operands":
        raise ValueError(f"linear_layers needs a recipe with placement 'operands', got {recipe}")

    def layers(model: nn.Module) -> dict:
        return {HEAD: None, **replace(recipe, keep_edges=False).layers(model)}

    return layers


def _bf16_layers(model: nn.Module) -> dict:
    bf16 = (BFLOAT16, "nearest")
    return {nn.Linear: LayerQuantization(input=bf16, output=bf16, error=bf16)}


@dataclass(frozen=True)
class GPTRecipe:
    """A recipe (see the module docstring).

    Attributes:
        name: what --recipe calls it.
        summary: one line for --list-recipes and the results table.
        layers: makes the inject() config for a model (None: nothing injected).
        functions: the quantize_functions config of the attention products (None: none).
        weight_format: None (float32 weights, torch.optim.AdamW) or the format every parameter is
            stored in by lpsim.optim.AdamW, with ``weight_rounding``.
        weight_rounding: "nearest" or "stochastic", for weight_format.
        cpu_only: its products run under lpsim.mac, which computes on the CPU only.
        token_transform: the transform of the weight gradient's operands along the tokens (the
            FP4 recipes' HADAMARD), whose groups the tokens of a step on one process must fill:
            their count, batch x context, a multiple of its size; None: none.
        deviations: where it departs from the published recipe it is named after, and why.
        multi_process: what a run in several processes (torchrun) computes otherwise than the
            recipe's one process, beyond the order of float32 sums (DistributedDataParallel adds
            the processes' weight gradients, each summed over its share of the batch); empty
            where nothing else differs. Every process draws the same random numbers (its
            stochastic rounding must round the weights as the others do), so the processes'
            shares of the batch get the same stochastic-rounding draws, where one process draws
            anew for every row; and a scale computed over a tensor of the batch (a per-tensor
            current scale, NVFP4's tensor scale) spans one process's share. Delayed scaling
            all-reduces its amaxes, and the weights' rounding and the block formats' per-row
            blocks are the same in every process.
    """

    name: str
    summary: str
    layers: Callable[[nn.Module], dict] | None = None
    functions: Mapping[str, LayerQuantization] | None = None
    weight_format: Float | None = None
    weight_rounding: str = "nearest"
    cpu_only: bool = False
    token_transform: lpsim.RandomHadamard | None = None
    deviations: tuple[str, ...] = ()
    multi_process: str = ""

    def build(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        seed: int,
    ) -> tuple[nn.Module, Optimizer, dict | None]:
        """Quantise ``model`` (in place) and make its optimizer; returns (model, optimizer,
        functions). ``seed`` keys lpsim.optim.AdamW's stochastic rounding (unused by the
        others)."""
        if self.layers is not None:
            inject(model, self.layers(model))
        groups = parameter_groups(model, weight_decay)
        if self.weight_format is None:
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas)
        else:
            optimizer = lpsim.optim.AdamW(
                groups,
                lr=lr,
                betas=betas,
                weight_format=self.weight_format,
                rounding=self.weight_rounding,
                seed=seed,
            )
        return model, optimizer, None if self.functions is None else dict(self.functions)


def _operands_recipe(name: str, forward, error, mac=None) -> Recipe:
    return Recipe(
        name,
        weight=forward,
        activation=forward,
        error=error,
        placement="operands",
        round_weights=False,
        keep_edges=False,
        mac=mac,
    )


_FP8_CURRENT = _operands_recipe("fp8-current", _E4M3_TENSOR, _E5M2_TENSOR)
_FP8_DELAYED = _operands_recipe("fp8-delayed", _E4M3_DELAYED, _E5M2_DELAYED)
_FP8_FUNCTIONS = attention_functions(_E4M3_TENSOR, _E5M2_TENSOR)
_FP8_DELAYED_FUNCTIONS = attention_functions(_E4M3_DELAYED, _E5M2_DELAYED)


def _attention_quantised(who: str) -> str:
    return (
        f"The two attention products take quantised operands here; {who} quantise the Linear "
        "layers' products and keep attention's in BF16."
    )


_WGRAD_REUSES_OPERANDS = (
    "Each operand is quantised once, with blocks along the forward product's reduction axis, and "
    "the backward products reuse it: the weight's blocks run along in_features where the input "
    "gradient reduces over out_features, and the error's and input's along the channels where "
    "the weight gradient reduces over the tokens. MX hardware takes blocks along each product's "
    "reduction axis, and MX training quantises the backward operands afresh along it."
)
_MXFP8_DEVIATIONS = (_WGRAD_REUSES_OPERANDS,)
_MXFP4_DEVIATIONS = (
    "Tseng et al. use MXFP4 in the backward products only and keep the forward products in "
    "higher precision (BF16); here the forward inputs and weights are MXFP4 too, rounded to "
    "nearest.",
    "Stochastically rounded operands take round-up scales (rceil) where Tseng et al. multiply "
    "by 3/4 before quantising (both keep stochastic rounding from saturating).",
    "The Hadamard transform's signs are fixed (seed 0) for every layer and step.",
    _attention_quantised("Tseng et al."),
)
_NVFP4_DEVIATIONS = (
    "NVIDIA keeps a share of the linear layers (some of the last blocks) in BF16; here every "
    "Linear but the head is NVFP4.",
    "The Hadamard transform's signs are fixed (seed 0) for every layer and step.",
    _attention_quantised("NVIDIA"),
)
_DEEPSEEK_DEVIATIONS = (
    "Only DeepSeek-V3's accumulation (promotion into float32 every 128 products) is simulated: "
    "its quantisation (E4M3 for every operand, errors included, in 1x128 tiles for "
    "activations and errors and 128x128 blocks for weights) is not; the operands are "
    "fp8-current's (per-tensor scales, E5M2 errors).",
    _attention_quantised("DeepSeek-V3"),
)


def _scaled(recipe: Recipe, summary: str, deviations: tuple[str, ...] = ()) -> GPTRecipe:
    along = recipe.along(-1)
    return GPTRecipe(
        recipe.name,
        summary,
        layers=linear_layers(along),
        functions=attention_functions(along.activation, along.error),
        deviations=deviations,
    )


HADAMARD = lpsim.RandomHadamard(16, axis=-1, seed=0)  # the FP4 recipes' weight-gradient transform
_MXFP4 = preset("mxfp4_e2m1")  # blocks along axis -1: each product's reduction axis below
_MXFP4_SR = (replace(_MXFP4, scale_rule="rceil"), "stochastic")
_NVFP4 = preset("nvfp4")
_NVFP4_SR = (_NVFP4, "stochastic")
MXFP4_LINEAR = LayerQuantization(
    input=(_MXFP4, "nearest"),
    weight=(_MXFP4, "nearest"),
    input_grad_operands=Operands(error=_MXFP4_SR, weight=_MXFP4_SR),
    weight_grad_operands=Operands(error=_MXFP4_SR, input=_MXFP4_SR, transform=HADAMARD),
)
NVFP4_LINEAR = LayerQuantization(
    input=(_NVFP4, "nearest"),
    weight=(replace(_NVFP4, block=(16, 16)), "nearest"),
    input_grad_operands=Operands(error=_NVFP4_SR),
    weight_grad_operands=Operands(error=_NVFP4_SR, input=(_NVFP4, "nearest"), transform=HADAMARD),
)


def _fp4(
    name: str,
    linear: LayerQuantization,
    summary: str,
    deviations: tuple[str, ...],
    multi_process: str,
) -> GPTRecipe:
    """An FP4 recipe: ``linear`` on every Linear but the head; attention's operands in its input
    format and errors in its input-gradient product's error format."""
    return GPTRecipe(
        name,
        summary,
        layers=lambda model: {HEAD: None, nn.Linear: linear},
        functions=attention_functions(linear.input, linear.input_grad_operands.error),
        token_transform=linear.weight_grad_operands.transform,
        deviations=deviations,
        multi_process=multi_process,
    )


def scaled_operands_mac(name: str) -> MAC:
    """lpsim.mac.preset(name) for operands that carry a per-tensor scale: the preset's tensor core
    with ``operands=None``, so that each operand is aligned by its own exponent (float32's emin),
    not clamped to the FP8 format's emin as though a scaled value were an FP8 code."""
    mac = lpsim.mac.preset(name)
    return replace(mac, tensor_core=replace(mac.tensor_core, operands=None))


_CURRENT_SCALES_PER_PROCESS = (
    "each process's share of the batch has its own per-tensor scale for every Linear input and "
    "error and every attention operand and error"
)


def _hopper(name: str, mac_name: str, summary: str, deviations: tuple[str, ...] = ()) -> GPTRecipe:
    mac = scaled_operands_mac(mac_name)
    return GPTRecipe(
        name,
        summary,
        layers=linear_layers(replace(_FP8_CURRENT, name=name, mac=mac)),
        functions=attention_functions(_E4M3_TENSOR, _E5M2_TENSOR, mac),
        cpu_only=True,
        deviations=deviations,
        multi_process=(
            f"{_CURRENT_SCALES_PER_PROCESS}; each process sums the weight gradients over its "
            "share's tokens on the tensor core, and the processes' sums are added in float32"
        ),
    )


RECIPES: dict[str, GPTRecipe] = {
    r.name: r
    for r in (
        GPTRecipe("fp32", "float32 throughout; torch.optim.AdamW"),
        GPTRecipe(
            "bf16-nearest",
            "bfloat16 weights (no float32 copy) updated by round to nearest; Linear inputs, "
            "outputs and errors bfloat16",
            layers=_bf16_layers,
            weight_format=BFLOAT16,
            weight_rounding="nearest",
        ),
        GPTRecipe(
            "bf16-stochastic",
            "bfloat16 weights (no float32 copy) updated by stochastic rounding; Linear inputs, "
            "outputs and errors bfloat16",
            layers=_bf16_layers,
            weight_format=BFLOAT16,
            weight_rounding="stochastic",
        ),
        GPTRecipe(
            "fp8-current",
            "E4M3 inputs and weights, E5M2 errors, per-tensor current scaling; head float32",
            layers=linear_layers(_FP8_CURRENT),
            functions=_FP8_FUNCTIONS,
            multi_process=_CURRENT_SCALES_PER_PROCESS,
        ),
        GPTRecipe(
            "fp8-delayed",
            "E4M3 inputs and weights, E5M2 errors, delayed scaling (amax history 16, max); "
            "head float32",
            layers=linear_layers(_FP8_DELAYED),
            functions=_FP8_DELAYED_FUNCTIONS,
        ),
        _scaled(
            MXFP8,
            "MXFP8: E4M3 forward, E5M2 errors, E8M0 scale per 32; head float32",
            _MXFP8_DEVIATIONS,
        ),
        _fp4(
            "mxfp4",
            MXFP4_LINEAR,
            "MXFP4: E2M1 per 32 (E8M0 scales); backward operands stochastic, Hadamard on the "
            "weight gradient's; head float32",
            _MXFP4_DEVIATIONS,
            "the processes' shares of the batch get the same stochastic-rounding draws for "
            "the backward products' operands, and where a share's tokens are not a multiple of "
            "32 the weight gradient's blocks along them end with the share",
        ),
        _fp4(
            "nvfp4",
            NVFP4_LINEAR,
            "NVFP4: E2M1, E4M3 scale per 16 and a tensor scale, 16x16 weight tiles; errors "
            "stochastic, Hadamard on the weight gradient's operands; head float32",
            _NVFP4_DEVIATIONS,
            "each process's share of the batch has its own tensor scale for every Linear input "
            "and error and every attention operand and error, and the shares get the same "
            "stochastic-rounding draws for the errors",
        ),
        _hopper(
            "fp8-hopper",
            "H100/e4m3",
            "fp8-current, every product on H100's FP8 tensor core (never promoted)",
        ),
        _hopper(
            "fp8-hopper-promoted",
            "DeepSeek-V3",
            "fp8-current, every product on H100's FP8 tensor core, promoted to float32 every 128",
            _DEEPSEEK_DEVIATIONS,
        ),
    )
}


def describe() -> str:
    """One line per recipe: its name and summary."""
    width = max(len(name) for name in RECIPES)
    return "\n".join(f"{name.ljust(width)}  {r.summary}" for name, r in RECIPES.items())

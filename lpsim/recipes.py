"""Named low-precision training recipes: what to quantise in a model and in its optimizer.

A Recipe applies to any model and optimizer:

    recipe = lpsim.recipes.IBM8
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = recipe.apply(model, sgd)
    loss = criterion(model(x), y)
    (loss * recipe.loss_scale).backward()     # OptimLP divides the gradients by it again
    optimizer.step()

Between backward() and step() the gradients are still loss_scale times the loss's: clip them at
max_norm * recipe.loss_scale (clip_grad_norm_ then scales them by the factor that max_norm gives
the unscaled gradients, up to rounding), not at max_norm, which would clip loss_scale times too
late.

Every recipe keeps the model's first and last weight layers (the first and last Conv,
ConvTranspose, Linear, Bilinear, MultiheadAttention or recurrent modules in registration order,
see edge_layers) in full precision, the usual
practice: their parameters, gradients, optimizer state, outputs and errors are never rounded (a
parameter they share with another module, as an embedding tied to the output layer, is not
quantised there either; that module's outputs and errors are). It quantises the rest: weights
and biases (of every other layer, normalisation layers and attention projections included:
fake-quantised in forward and rounded after every step), activations (every layer's outputs),
errors (the gradients flowing back into those outputs), gradients, and the optimizer's state, with
an optional high-precision weight accumulator. The optimizer rounds exactly
the parameters the model fake-quantises (lpsim.nn.quantized_parameters), so `lpsim.nn.report(model,
optimizer)` shows both agree. The scaled recipes (MXFP8, MXFP4, NVFP4: placement "operands",
round_weights False) quantise less: only the operands of the inner weight layers' products (their
weights and inputs in forward, the errors into their outputs in backward); biases, normalisation
layers, other layers' outputs, gradients and the optimizer's state stay in full precision, and the
optimizer rounds no weight.

Reproductions of other code bases place the quantisers themselves and round every parameter, as
QPyTorch's examples do:

    model, optimizer = recipe.apply(model, optimizer, layers={nn.ReLU: LayerQuantization(
        output=recipe.activation, error=recipe.error)}, parameters="all")
    optimizer.round_weights()                 # low-precision weights from the first forward pass
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch import nn
from torch.optim import Optimizer

from lpsim._checks import check_bool, check_positive_finite
from lpsim.formats import BlockFloat, Fixed, Float
from lpsim.mac import MAC
from lpsim.nn.inject import LayerQuantization, inject, injected, quantized_parameters, remove
from lpsim.nn.quantizer import Spec
from lpsim.optim.optim_lp import OptimLP, ParameterQuantization, check_wrappable
from lpsim.scaled import Scaled, preset

__all__ = [
    "Recipe",
    "FP32",
    "BFLOAT16",
    "IBM8",
    "BLOCK8",
    "FIXED8",
    "FIXED8_UNSCALED",
    "MXFP8",
    "MXFP4",
    "NVFP4",
    "RECIPES",
    "edge_layers",
]

WEIGHT_LAYERS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
    nn.MultiheadAttention,
)
# Each weight layer's reduction axes (Recipe.blocks_along_reduction), counted from the end so that
# unbatched inputs have them too: (types, the axis of their inputs and errors, that of their
# weight). The features of a Linear layer's and an attention's (..., features) inputs and errors
# and (out, in) weights; the channels of a convolution's (batch, channel, *spatial) inputs and
# errors and the input channels of its (out, in, *kernel) weight, which a transposed convolution
# holds first, (in, out, *kernel).
_REDUCTION_AXES = (
    ((nn.Linear, nn.MultiheadAttention), -1, -1),
    (nn.Conv1d, -2, -2),
    (nn.Conv2d, -3, -3),
    (nn.Conv3d, -4, -4),
    (nn.ConvTranspose1d, -2, -3),
    (nn.ConvTranspose2d, -3, -4),
    (nn.ConvTranspose3d, -4, -5),
)
# The layers that can be a model's first or last weight layer: the weight layers above and the
# others with weights of their own that the recipes give no entry of their own (a bilinear layer,
# a recurrent first layer or cell).
_EDGE_CANDIDATES = (
    *WEIGHT_LAYERS,
    nn.Bilinear,
    nn.RNNBase,
    nn.RNNCellBase,
)


def attention_out_projections(model: nn.Module) -> dict[str, str]:
    """The out projections of the model's MultiheadAttention modules, by name, each with its
    attention's name: Linear modules whose forward the attention never calls (it reads their
    parameters), so their input, output and error quantisers never run: the out projection's
    output and error are the attention's, and its input, the attention's context, is never
    quantised."""
    return {
        f"{name}.out_proj" if name else "out_proj": name
        for name, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def edge_layers(model: nn.Module) -> list[str]:
    """Names of the first and last weight layers (Conv, ConvTranspose, Linear, Bilinear,
    MultiheadAttention, RNN/LSTM/GRU and their cells; an attention's out projection counting as
    part of it) of the model, in the order ``model.named_modules()`` gives them: the order the
    modules were registered, which is the order of the forward pass in nn.Sequential models and
    most CNNs, but not in a model that registers, say, its head before
    its stem. Such a model needs its own ``layers=`` configuration for Recipe.apply, its edge
    layers set to None.

    Raises:
        TypeError: model is not an nn.Module.
    """
    _check_model(model)
    inner = attention_out_projections(model)
    names = [
        n for n, m in model.named_modules() if isinstance(m, _EDGE_CANDIDATES) and n not in inner
    ]
    return sorted({names[0], names[-1]}) if names else []


def _sharing_kept_parameters(model: nn.Module, kept: list[str]) -> dict:
    """{name: (module, kinds)} for every module but the ``kept`` ones that has a parameter of
    its own which a kept module also has (tied weights): kinds names what LayerQuantization
    would quantise it as, "weight" or "bias" (see LayerQuantization)."""
    held = {id(p) for name in kept for p in model.get_submodule(name).parameters()}
    found = {}
    for name, module in model.named_modules():
        if not held or name in kept:
            continue
        kinds = set()
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in held:
                bias = pname.endswith("bias") or pname.startswith("bias_")
                kinds.add("bias" if bias else "weight")
        if kinds:
            found[name] = (module, sorted(kinds))
    return found


@dataclass(frozen=True)
class Recipe:
    """A low-precision training recipe. Specs are None, a format, or (format, rounding).

    Attributes:
        name: short label.
        weight, activation, error, grad, momentum, acc: what each category is rounded into.
        loss_scale: multiply the loss by this before backward; the optimizer undoes it before
            quantising the gradients, also in a recipe that quantises nothing, by multiplying
            them by 1 / loss_scale (OptimLP's grad_scaling): exact for a power of two, and
            otherwise rounded twice (the factor, then the product), which may differ from
            gradient / loss_scale by one unit in the last place. A positive finite number
            (ValueError otherwise).
        keep_edges: keep the first and last weight layers in full precision (a bool; TypeError
            otherwise, as for round_weights).
        placement: where the model's quantisers go. "outputs" (the default, QPyTorch's
            practice): weights and biases of every layer (normalisation layers included) and
            every layer's outputs (``activation``) and errors. "operands" (FP8 and MX training):
            only the operands of the weight layers' products (Conv, ConvTranspose, Linear and
            MultiheadAttention layers): their weights, their inputs (``activation``) and the
            errors flowing into their outputs; biases, normalisation layers and everything else
            stay in full precision, bilinear and recurrent layers (RNN, LSTM, GRU and their
            cells) included.
        round_weights: whether the optimizer rounds the weights after every step (by ``weight``;
            a Scaled ``weight`` with the blocks forward quantises each parameter in, along its
            layer's reduction axis or a bias's one axis, so that the stored weights are what
            forward multiplies; forward rounds them again, which leaves them unchanged where the
            format's rounding of its own values is the identity, but not for a format with a
            tensor scale (NVFP4's, recomputed from the stored weights' amax, which their rounding
            moved: every element of the tensor can change) nor MXINT8 (a block whose largest
            magnitude rounded to the element -2 takes twice the scale when rounded again), nor
            a DelayedScaling (the optimizer's scaler and forward's keep amax histories of their
            own, and so scales of their own).
            False keeps full-precision master weights in the parameters,
            which the model sees quantised by ``weight`` in every forward pass only, as FP8 and
            MX training do.
        blocks_along_reduction: whether every Scaled format of a weight layer's quantisers
            (weight, bias, input, output, error) whose blocks run along an axis (not tiles, nor
            one block for the whole tensor, which stay as they are) takes its blocks along that
            layer's reduction axis instead of its own ``axis``: the channels of a convolution's
            (batch, channel, *spatial) inputs and errors and (out, in, *kernel) weights, counted
            from the end (-2, -3 and -4 for Conv1d, Conv2d and Conv3d, so that unbatched inputs
            have it too);
            the same for a transposed convolution's inputs and errors, and the input channels
            of its (in, out, *kernel) weight, its first axis (-3, -4 and -5 for ConvTranspose1d,
            2d and 3d); -1 for Linear layers and MultiheadAttention (inputs (..., features) of
            any rank, (out, in) weights). The scaled recipes (MXFP8, MXFP4, NVFP4) set it, so that a
            Linear layer's 3-D (batch, token, channel) input is blocked along its channels, not
            its tokens; ``along`` clears it. A bias (placement "outputs") is blocked along its one
            axis, and so are the weight and bias of one axis of any other leaf layer (a norm
            layer's, a PReLU's), whatever the recipe's axis; the outputs and errors of the layers
            that are not weight layers (placement "outputs") keep the recipe's axis (1 in the
            scaled recipes: the channels of a (batch, channel, ...) tensor, the tokens of a
            (batch, token, channel) one; ``along(-1)`` blocks a token model's along channels).
            A depthwise convolution's weight (channels, 1, ...) has blocks of one element. In a
            grouped convolution (groups > 1) each group's product sums over its own in / groups
            channels, but the blocks of a tensor's channels run on across the groups: where
            in / groups is not a multiple of the block size, a block holds the channels of two or
            more groups (in a depthwise convolution's input, of 32 groups for MX) and takes one
            scale for them, where hardware would scale each group's channels apart.
        mac: the arithmetic of the weight layers' products, forward and backward (an lpsim.MAC;
            None: torch's own): every Linear, Conv1d, Conv2d and MultiheadAttention it reaches
            (all of them unless ``keep_edges``) sums its products as the MAC prescribes
            (lpsim.nn.functional). A MultiheadAttention's in projection (its own parameters, no
            Linear) is rounded like the weight layers' weights and biases, and so is its out
            projection's weight (and bias), whose output and error are the attention's. What
            lies inside the attention is not quantised under either placement: the in
            projection's outputs (q, k, v) and their errors, the operands of its two products, and
            the out projection's input (the context). So under "operands" the in projection
            multiplies a quantised input and weight, the out projection a full-precision context
            and a quantised weight, and their backward products take the quantised error of the
            attention's output but full-precision errors of q, k and v.
    """

    name: str
    weight: Spec = None
    activation: Spec = None
    error: Spec = None
    grad: Spec = None
    momentum: Spec = None
    acc: Spec = None
    loss_scale: float = 1.0
    keep_edges: bool = True
    placement: str = "outputs"
    round_weights: bool = True
    blocks_along_reduction: bool = False
    mac: MAC | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Recipe.name must be a str, got {type(self.name).__name__}")
        check_positive_finite("Recipe.loss_scale", self.loss_scale)
        # A truthy string meant as "off" ("no", "False") would keep the edges or round weights.
        check_bool("Recipe.keep_edges", self.keep_edges)
        check_bool("Recipe.round_weights", self.round_weights)
        check_bool("Recipe.blocks_along_reduction", self.blocks_along_reduction)
        if self.mac is not None and not isinstance(self.mac, MAC):
            raise TypeError(
                f"Recipe.mac must be a lpsim.MAC or None, got {type(self.mac).__name__}"
            )
        if self.placement not in _PLACEMENTS:
            raise ValueError(
                f"Recipe.placement must be one of {_PLACEMENTS}, got {self.placement!r}"
            )

    @property
    def quantises(self) -> bool:
        """Whether the recipe rounds anything (a format in some category, or a MAC)."""
        return any(
            getattr(self, f) is not None
            for f in ("weight", "activation", "error", "grad", "momentum", "acc", "mac")
        )

    def along(self, axis: int) -> Recipe:
        """This recipe with every Scaled format's blocks along ``axis`` in every layer (and
        ``blocks_along_reduction`` off): the scaled recipes otherwise block each weight layer's
        operands along its reduction axis (the channels for convolutions, -1 for Linear
        layers). Tiles and whole-tensor blocks, which run along no axis, stay as they are."""
        fields = ("weight", "activation", "error", "grad", "momentum", "acc")
        moved = {f: _blocks_along(getattr(self, f), axis) for f in fields}
        return replace(self, **moved, blocks_along_reduction=False)

    def layers(self, model: nn.Module) -> dict:
        """The inject() configuration of this recipe for model. A parameter of a kept edge layer
        that another module shares (an embedding tied to the output layer, say) stays in full
        precision there too: that module's weight (or bias) is not quantised, its other
        quantisers are as the recipe says. TypeError when model is not an nn.Module."""
        _check_model(model)
        edges = edge_layers(model) if self.keep_edges else []
        config = {_Named(name): None for name in edges}
        shared = _sharing_kept_parameters(model, edges)
        # A MultiheadAttention's out projection: its weight (and bias) rounded as the layers'
        # below, its input, output and error left to the attention's own quantisers; in full
        # precision where the attention is.
        projection = LayerQuantization(
            weight=self.weight, bias=self.weight if self.placement == "outputs" else None
        )
        if self.blocks_along_reduction:  # a Linear's (out, in) weight: along in
            projection = _layer_blocks_along(projection, -1, -1)
        for name, attention in attention_out_projections(model).items():
            config[_Named(name)] = (
                None if config.get(_Named(attention), True) is None else projection
            )
        if self.placement == "operands":
            weight_layer = LayerQuantization(
                weight=self.weight, input=self.activation, error=self.error, mac=self.mac
            )
            other = None
        else:
            other = LayerQuantization(
                weight=self.weight, bias=self.weight, output=self.activation, error=self.error
            )
            weight_layer = replace(other, mac=self.mac)
        weight_layers = {WEIGHT_LAYERS: weight_layer}
        if self.blocks_along_reduction:  # an entry per kind of weight layer the model has
            weight_layers = {
                types: _layer_blocks_along(weight_layer, axis, weight_axis)
                for types, axis, weight_axis in _REDUCTION_AXES
                if any(isinstance(m, types) for m in model.modules())
            }

        def entry_of(module: nn.Module) -> LayerQuantization | None:
            found = (e for types, e in weight_layers.items() if isinstance(module, types))
            return next(found, other)

        for name, (module, kinds) in shared.items():
            entry = entry_of(module)
            if entry is not None and _Named(name) not in config:
                config[_Named(name)] = replace(entry, **dict.fromkeys(kinds))
        config.update(weight_layers)
        if other is not None:
            one_axis = _leaves_with_one_axis_parameters(model, WEIGHT_LAYERS)
            if one_axis:  # a norm's (channels,) weight and bias: blocked along their one axis
                weight, bias = _blocks_along(other.weight, -1), _blocks_along(other.bias, -1)
                if (weight, bias) != (other.weight, other.bias):
                    config[_modules_selector(one_axis)] = replace(other, weight=weight, bias=bias)
        config["default"] = other
        return config

    def apply(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        layers: Mapping | None = None,
        parameters: str = "quantized",
    ) -> tuple[nn.Module, Optimizer]:
        """Inject the recipe into ``model`` (in place) and wrap ``optimizer`` in OptimLP with the
        recipe's weight, grad, momentum and acc and gradients divided by its loss scale; returns
        (model, wrapped optimizer). Without ``layers``, a recipe that quantises nothing and scales
        no loss (scale 1) returns both unchanged, and one that only scales the loss returns the
        model unchanged and the optimizer wrapped, dividing the gradients by the scale; either
        takes out the quantisers a recipe or inject() put in the model before (another recipe
        replaces them with its own). Given ``layers`` are injected whatever the recipe.

        Args:
            model: the model to quantise.
            optimizer: a torch.optim optimizer over the model's parameters, all of them or some
                (the others frozen: forward still quantises them where the recipe says). A
                parameter group added later (``add_param_group``) takes the recipe's formats
                unless it sets ``"quantization": None``: give that key to the groups of
                parameters the model keeps in full precision (the first and last layers').
            layers: the inject() configuration to use instead of ``self.layers(model)``: where
                the quantisers go (QPyTorch's examples place them after chosen layers). Every
                entry must decide a module (inject's unmatched="error"); the recipe's own
                configuration may leave an entry unused.
            parameters: which parameters the optimizer rounds: "quantized" (default) those of
                its parameters that the model fake-quantises (lpsim.nn.quantized_parameters), so
                that forward and the optimizer agree; "all" every parameter of the optimizer, as
                QPyTorch's OptimLP does.

        Raises:
            TypeError: model is not an nn.Module, or optimizer not a torch optimizer or an
                OptimLP already (a recipe applied before: pass ``optimizer.optimizer``, which
                takes this recipe afresh); the model is left as it was.
            ValueError: parameters is neither "quantized" nor "all", or an entry of ``layers``
                decides no module.
            TypeError, ValueError: as inject() and OptimLP for malformed settings (a format that
                does not fit a tensor's dtype, say); a model that carried no quantisers is
                then left as it was (one injected before keeps the recipe's quantisers).
        """
        _check_model(model)
        check_wrappable(optimizer)  # before inject: no half-applied recipe
        if parameters not in _PARAMETERS:
            raise ValueError(f"parameters must be 'quantized' or 'all', got {parameters!r}")
        if not self.quantises and layers is None:
            # As another recipe's inject() replaces them, this one takes out the quantisers of a
            # recipe applied before: the model must not round what the optimizer does not.
            if injected(model):
                remove(model)
            if self.loss_scale == 1.0:
                return model, optimizer
            # Nothing to round, but the caller multiplies the loss by loss_scale: the optimizer
            # must still divide the gradients by it.
            return model, OptimLP(optimizer, grad_scaling=1.0 / self.loss_scale)
        fresh = not injected(model)  # then remove() puts it back as it is, should OptimLP refuse
        if layers is None:
            # The configuration is built for this model: an entry may decide nothing (a model
            # with two weight layers has no other to quantise), which is not a mistake here.
            inject(model, self.layers(model), unmatched="ignore")
        else:
            inject(model, layers)
        chosen = None
        if parameters == "quantized":
            # Of the parameters forward fake-quantises, those the optimizer trains: a model whose
            # optimizer holds only some of its parameters (others frozen, as in fine-tuning) still
            # sees the frozen ones quantised in forward, and the optimizer has none of them.
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            chosen = [p for p in quantized_parameters(model) if id(p) in held]
            if self.round_weights:
                chosen = self._weights_as_forward(model, chosen)
        try:
            wrapped = OptimLP(
                optimizer,
                weight=self.weight if self.round_weights else None,
                grad=self.grad,
                momentum=self.momentum,
                acc=self.acc,
                grad_scaling=1.0 / self.loss_scale,
                parameters=chosen,
            )
        except BaseException:
            if fresh:  # no half-applied recipe: the model loses the quantisers too
                remove(model)
            raise
        return model, wrapped

    def _weights_as_forward(self, model: nn.Module, chosen: list) -> list | dict:
        """``chosen`` (the parameters the optimizer rounds), or where forward quantises one of
        them with a Scaled ``weight`` whose blocks run along another axis than the recipe's
        (blocks_along_reduction, a bias), OptimLP's mapping of each to its settings: ``weight``
        with the blocks forward uses, so that the optimizer stores what forward multiplies."""
        fmt = self.weight[0] if isinstance(self.weight, tuple) and self.weight else self.weight
        if not _has_block_axis(fmt):
            return chosen  # no Scaled weight with blocks along an axis
        axes = _forward_block_axes(model, fmt)
        axis = fmt.axis

        def forward_axis(p) -> int | None:  # None: the recipe's own axis
            found = axes.get(id(p))
            dims = max(p.dim(), 1)
            same = found is None or (-dims <= axis < dims and axis % dims == found % dims)
            return None if same else found

        if all(forward_axis(p) is None for p in chosen):
            return chosen
        settings = {}
        for p in chosen:
            moved = forward_axis(p)
            weight = self.weight if moved is None else _blocks_along(self.weight, moved)
            settings[p] = ParameterQuantization(
                weight=weight, grad=self.grad, momentum=self.momentum, acc=self.acc
            )
        return settings


def _forward_block_axes(model: nn.Module, fmt: Scaled) -> dict[int, int]:
    """{id(parameter): axis} for every parameter that forward fake-quantises by itself (its
    parametrisation computed from it alone) with ``fmt`` along some axis: that axis."""
    axes = {}
    for _, module, done in injected(model):
        for pname, spec in done["weight"] + done["bias"]:
            original = getattr(module.parametrizations[pname], "original", None)
            same = _has_block_axis(spec.format) and replace(spec.format, axis=fmt.axis) == fmt
            if isinstance(original, nn.Parameter) and same:
                axes.setdefault(id(original), spec.format.axis)
    return axes


def _has_block_axis(fmt) -> bool:
    """Whether fmt is a Scaled format whose blocks run along its ``axis`` (blocks of n, or the
    whole axis; not tiles or the whole tensor)."""
    return isinstance(fmt, Scaled) and (fmt.block is None or isinstance(fmt.block, int))


def _blocks_along(spec, axis: int):
    """A spec (None, a format, or (format, rounding)) with a Scaled format's blocks along axis;
    tiles and whole-tensor blocks, which run along no axis, as they are."""
    if _has_block_axis(spec):
        return replace(spec, axis=axis)
    if isinstance(spec, tuple) and spec and _has_block_axis(spec[0]):
        return (replace(spec[0], axis=axis), *spec[1:])
    return spec


def _leaves_with_one_axis_parameters(model: nn.Module, skipped: tuple) -> set[int]:
    """The ids of the leaf modules of ``model``, but those of the ``skipped`` types, with a weight
    or bias of fewer than two dimensions (a norm layer's, a PReLU's)."""
    return {
        id(module)
        for module in model.modules()
        if not isinstance(module, skipped)
        and next(module.children(), None) is None
        and any(
            p.dim() < 2
            for name, p in module.named_parameters(recurse=False)
            if name.endswith(("weight", "bias"))
        )
    }


@dataclass(frozen=True, repr=False)
class _Named:
    """An inject() selector of the module whose qualified name is exactly ``name``: a name as a
    glob pattern would select other modules, or none, where it holds "*", "?" or "[" (a
    ModuleDict's key "stem[0]"), and the name "default" is the key of inject's fallback entry."""

    name: str

    def __call__(self, name: str, module: nn.Module) -> bool:
        return name == self.name

    def __repr__(self) -> str:
        return repr(self.name)


def _modules_selector(ids: set[int]):
    """An inject() selector of the modules whose ids are in ``ids``."""

    def parameters_with_one_axis(name: str, module: nn.Module) -> bool:
        return id(module) in ids

    return parameters_with_one_axis


def _layer_blocks_along(entry: LayerQuantization, axis: int, weight_axis: int) -> LayerQuantization:
    """A weight layer's entry with its Scaled formats' blocks along axis, its weight's along
    weight_axis (a bias's along its one axis)."""
    moved = {f: _blocks_along(getattr(entry, f), axis) for f in ("input", "output", "error")}
    weight = _blocks_along(entry.weight, weight_axis)
    return replace(entry, **moved, weight=weight, bias=_blocks_along(entry.bias, -1))


_PARAMETERS = ("quantized", "all")  # what Recipe.apply's optimizer rounds
_PLACEMENTS = ("outputs", "operands")  # where Recipe.layers puts the model's quantisers

FP32 = Recipe("fp32")

BFLOAT16 = Recipe(
    "bfloat16",
    weight=(Float(8, 7), "nearest"),
    activation=(Float(8, 7), "nearest"),
    error=(Float(8, 7), "nearest"),
    grad=(Float(8, 7), "nearest"),
    momentum=(Float(8, 7), "nearest"),
)

# After Wang et al., "Training Deep Neural Networks with 8-bit Floating Point Numbers" (NeurIPS
# 2018) as in QPyTorch's IBM8 example: 8-bit e5m2 data with round-to-nearest, a 16-bit e6m9
# accumulator and momentum with stochastic rounding, and loss scaling. As in that example, the
# products are summed in full precision: the paper's FP16 chunk-based accumulation inside every
# GEMM is not simulated (a MAC with a chunked e6m9 accumulator would). Where experiments/cifar10's
# ibm8 (QPyTorch's PreResNet20LP) rounds the network's input and logits into e6m9, this recipe
# keeps the first and last weight layers in full precision (keep_edges). The formats are IEEE-like,
# unlike QPyTorch's: round to nearest ties to even (QPyTorch's rounds ties away from zero), e5m2
# saturates at 57344 (QPyTorch's top exponent is finite: 114688), and e6m9 overflows to Inf beyond
# 2^31 (2 - 2^-9) (QPyTorch's saturates one binade higher).
_E5M2 = Float(5, 2, saturate=True)
IBM8 = Recipe(
    "ibm8",
    weight=(_E5M2, "nearest"),
    activation=(_E5M2, "nearest"),
    error=(_E5M2, "nearest"),
    grad=(_E5M2, "nearest"),
    momentum=(Float(6, 9), "stochastic"),
    acc=(Float(6, 9), "stochastic"),
    loss_scale=1000.0,
)

# 8-bit block floating point, one shared exponent per tensor, for all five categories
# (the QPyTorch paper's Block8 recipe).
BLOCK8 = Recipe(
    "block8",
    weight=(BlockFloat(8), "stochastic"),
    activation=(BlockFloat(8), "stochastic"),
    error=(BlockFloat(8), "stochastic"),
    grad=(BlockFloat(8), "stochastic"),
    momentum=(BlockFloat(8), "stochastic"),
)

# 8-bit fixed point with stochastic rounding for all five categories: weights, gradients and
# momentum with 6 fractional bits, activations and errors with 4. The loss is scaled by 2^8, so in
# unscaled units the errors' Fixed(8, 4) grid has spacing 2^-12 and reaches 2^-5. In the demo's
# CNN the largest errors are 1e-2 to 3e-2 and the typical ones 1e-4 to 1e-6: the grid holds the
# large ones and rounds the small ones stochastically, unbiased. OptimLP divides the gradients by
# 2^8 again before rounding them.
FIXED8 = Recipe(
    "fixed8",
    weight=(Fixed(8, 6), "stochastic"),
    activation=(Fixed(8, 4), "stochastic"),
    error=(Fixed(8, 4), "stochastic"),
    grad=(Fixed(8, 6), "stochastic"),
    momentum=(Fixed(8, 6), "stochastic"),
    loss_scale=256.0,
)

# The counter-example: the same formats without the loss scale. The 2^-4 spacing is above even the
# largest errors, so every error becomes 0 or +-2^-4 (unbiased, with a variance far above its
# size), and accuracy stalls far below the other recipes. Fixed-point recipes scale their errors
# for this reason (a loss scale, or WAGE's per-layer shift).
FIXED8_UNSCALED = replace(FIXED8, name="fixed8-unscaled", loss_scale=1.0)


def _channels(name: str) -> Scaled:
    return replace(preset(name), axis=1)


# Scaled formats on the operands of every product (weights and inputs of the weight layers in
# every forward pass, the errors into their outputs in every backward pass), blocks along each
# product's reduction axis (blocks_along_reduction: the channels, axis 1, of a convolution's
# operands, the features, axis -1, of a Linear layer's; Recipe.along fixes one axis), and
# full-precision master weights, biases, gradients and optimizer state, as MX and NVFP4 training
# keep them.
# Each operand is quantised once, its blocks along the forward product's reduction axis, and the
# backward products reuse those quantised tensors (the weight gradient multiplies the quantised
# error and input): there the weight's, input's and error's blocks do not run along the backward
# products' reduction axes, where MX and NVFP4 hardware needs them and the published recipes
# quantise each backward operand afresh (lpsim.nn.functional.Operands does; experiments/gpt's
# mxfp4 and nvfp4 recipes use it).
# MXFP8 after the OCP MX paper (Rouhani et al., "Microscaling Data Formats for Deep Learning",
# 2023): E4M3 forward, E5M2 errors, round to nearest.
MXFP8 = Recipe(
    "mxfp8",
    weight=(_channels("mxfp8_e4m3"), "nearest"),
    activation=(_channels("mxfp8_e4m3"), "nearest"),
    error=(_channels("mxfp8_e5m2"), "nearest"),
    placement="operands",
    round_weights=False,
    blocks_along_reduction=True,
)

# MXFP4 with stochastically rounded errors (Tseng et al., "Training LLMs with MXFP4", 2025, round
# the backward pass's operands stochastically so that its products are unbiased). The errors take
# round-up scales ("rceil"): with OCP's floor scale a block's largest elements reach nearly 8
# times the scale, above E2M1's largest value 6, and stochastic rounding saturates them, a bias
# toward zero (Tseng et al. multiply by 3/4 before quantising instead). Not Tseng et al.'s recipe:
# they keep the forward products in higher precision (BF16) and use MXFP4 in the backward
# products only, quantise every backward operand (weights and inputs too) stochastically, and
# apply a random Hadamard transform to the weight gradient's operands; here the forward operands
# are MXFP4 rounded to nearest, only the errors are stochastic, and nothing is transformed.
MXFP4 = Recipe(
    "mxfp4",
    weight=(_channels("mxfp4_e2m1"), "nearest"),
    activation=(_channels("mxfp4_e2m1"), "nearest"),
    error=(replace(_channels("mxfp4_e2m1"), scale_rule="rceil"), "stochastic"),
    placement="operands",
    round_weights=False,
    blocks_along_reduction=True,
)

# NVFP4 after NVIDIA's recipe ("Pretraining Large Language Models with NVFP4", 2025): E2M1 with
# an E4M3 scale per 16 and a float32 tensor scale, round to nearest forward, stochastic rounding of
# the gradients. NVIDIA scales weights in 16x16 tiles and applies a random Hadamard transform to
# the weight-gradient product's operands, quantised along the tokens; here weights use the same
# 1x16 blocks along the input channels as the rest, and the weight gradient takes the operands
# the error and the input were quantised into, with no transform: lpsim.nn.functional.Operands
# places both on Linear layers (experiments/gpt's nvfp4 recipe), not yet on convolutions. NVIDIA
# also keeps a share of the linear layers (some of the last blocks) in BF16; here only the first
# and last weight layers stay in full precision (keep_edges).
NVFP4 = Recipe(
    "nvfp4",
    weight=(_channels("nvfp4"), "nearest"),
    activation=(_channels("nvfp4"), "nearest"),
    error=(_channels("nvfp4"), "stochastic"),
    placement="operands",
    round_weights=False,
    blocks_along_reduction=True,
)

RECIPES = {
    r.name: r for r in (FP32, BFLOAT16, IBM8, BLOCK8, FIXED8, FIXED8_UNSCALED, MXFP8, MXFP4, NVFP4)
}

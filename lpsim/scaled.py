"""Scaled formats: small elements times a shared scale per block (OCP MX, NVFP4, scaled FP8).

A scaled format stores each element in an element format (a Float or Fixed) and one scale per block
of elements; the value an element stands for is element * scale. lpsim simulates it as every other
format: ``quantize(x, fmt)`` returns, in x's dtype, the value every element decodes to.

    >>> import torch, lpsim
    >>> from lpsim.scaled import preset
    >>> x = torch.tensor([[0.1, -3.0, 17.0, 1000.0]])
    >>> lpsim.quantize(x, preset("mxfp4_e2m1"))  # one E8M0 scale 2**7; 1000 / 2**7 saturates to 6
    tensor([[  0.,  -0.,   0., 768.]])

The parts of a scaled format (class Scaled):

- ``element``: the element format, a Float or Fixed. Elements always saturate: a value beyond the
  largest element rounds to it, whatever the element's own ``saturate``/``clamp`` says (OCP MX
  section 6.3); an element format's Inf and NaN codes are never produced by rounding.
- ``scale``: PowerOfTwo (OCP's E8M0 for exp=8) or a Float, such as E4M3 (NVFP4's UE4M3: the sign
  is never used) or Float(8, 23), float32 scales.
- ``block``: which elements share a scale: blocks of n consecutive elements along ``axis``, the
  whole axis (one scale per row, token or channel), 2-D tiles over the last two dimensions, or the
  whole tensor. A last block that is shorter is scaled from the elements it has (as if padded with
  zeros, which do not change its largest magnitude).
- ``scale_rule``: how a block's scale follows from its largest magnitude amax.
- ``tensor_scale``: a second, per-tensor float32 scale (NVFP4); computed in the format's
  arithmetic, so a float64 tensor's is a float64 number, not rounded to float32.

How a block is encoded (``emax`` is the exponent of the largest element ``elem_max``):

Power-of-two scales, 2**e with e clamped to the scale's exponent range ([-127, 127] for E8M0):

- ``"floor"`` (OCP MX 1.0, section 6.3): e = floor(log2(amax)) - emax.
- ``"ceil"``: e = ceil(log2(amax)) - emax.
- ``"even"``: e = floor(log2(amax')) - emax, amax' being amax rounded to the element's precision
  (fraction bits of its largest binade) with ties away from zero, so that a block whose largest
  value would round up into the next binade gets the larger scale (torchao's
  ScaleCalculationMode.EVEN).
- ``"rceil"``: e = ceil(log2(amax / elem_max)), the division rounded in float32 (float64 for
  float64 tensors): the smallest scale at which nothing saturates (NVIDIA's cvt.rp to UE8M0).

An all-zero block has the smallest scale. Each element is x / 2**e rounded onto the element grid
by the rounding rule, exactly (one rounding), and decodes to that times 2**e.

Float scales, ``"amax"`` (amax-to-max scaling), in float32 arithmetic (float64 for float64
tensors), each operation rounded to nearest even, as torchao's NVFP4 computes it (Transformer
Engine's and DeepSeek-V3's FP8 scaling order the operations otherwise, docs/formats.md says how):

    d = amax / elem_max                     (two levels: d = (amax / elem_max) / t)
    s = d clamped to [the scale's smallest normal, its max], rounded to the scale format
    r = 1 / s                               (two levels: r = (1 / t) / s)
    element = round(x * r),   value = element * s      (two levels: element * (t * s))

The tensor scale is t = amax(tensor) / (scale max * elem_max), at least 2**-126 / (the scale's
smallest normal), so that 1 / (t * s) is finite for every scale s; a two-level format's elements
reach at least 2 (elem_max >= 2), so that t * s, about amax / elem_max, is finite. A block (or,
for t, a tensor) that holds a NaN or an Inf decodes to NaN throughout: the OCP spec's NaN scale.

Values are computed in float32 for float32, bfloat16 and float16 tensors and rounded to nearest
into the tensor's dtype at the end; in float64 for float64 tensors. In a bfloat16 or float16
tensor the values of a format with float scales are those decoded values rounded into the
tensor's dtype, and every rule returns an input equal to one of them unchanged: such an input may
round differently from the same value in a float32 tensor (docs/formats.md, "Which container").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lpsim.formats import (
    Fixed,
    Float,
    GridSpec,
    check_bool_field,
    check_fits,
    check_int_field,
    field_state,
    short_repr,
    stored_grid,
)

__all__ = [
    "PowerOfTwo",
    "Scaled",
    "SCALE_RULES",
    "SCALED_PRESETS",
    "preset",
]

# Scale rules: the first four for PowerOfTwo scales, "amax" for Float scales. The position of a
# name is its code in the compiled op (csrc/include/lpsim/scaled.h, ScaleRule).
SCALE_RULES = ("floor", "ceil", "even", "rceil", "amax")
POWER_OF_TWO_RULES = SCALE_RULES[:4]


@dataclass(frozen=True, repr=False)
class PowerOfTwo:
    """A scale format of powers of two: code k in [0, 2**exp - 2] is 2**(k - bias), the all-ones
    code is NaN; no sign, no zero, no Inf. PowerOfTwo(8) is OCP's E8M0: 2**-127 to 2**127.

    Args:
        exp: bits of the code, 1 to 8.
        bias: default 2**(exp-1) - 1.

    Raises:
        TypeError, ValueError: a field has the wrong type or is out of range.
    """

    exp: int = 8
    bias: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_int_field("PowerOfTwo", "exp", self.exp, 1, 8)
        if self.bias is None:
            object.__setattr__(self, "bias", self.default_bias)
        check_int_field("PowerOfTwo", "bias", self.bias, -126, 2**self.exp + 125)
        # The range must lie within float32's (normal or subnormal) powers of two.
        if self.emin < -149 or self.emax > 127:
            raise ValueError(
                f"{self!r} spans 2**{self.emin} to 2**{self.emax}; scales must lie in "
                "[2**-149, 2**127]"
            )

    @property
    def default_bias(self) -> int:
        return 2 ** (self.exp - 1) - 1

    __repr__ = short_repr
    __getstate__ = field_state

    @property
    def bits(self) -> int:
        return self.exp

    @property
    def emin(self) -> int:
        """Exponent of the smallest scale."""
        return -self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest scale."""
        return 2**self.exp - 2 - self.bias

    @property
    def max(self) -> float:
        return math.ldexp(1.0, self.emax)

    @property
    def smallest_normal(self) -> float:
        """The smallest scale, 2**emin."""
        return math.ldexp(1.0, self.emin)

    def grid(self) -> GridSpec:
        """The scales as a grid (one significant bit, no subnormals): what the compiled op reads
        its exponent range from."""
        return stored_grid(self)

    def _build_grid(self) -> GridSpec:
        return GridSpec(
            keep=0,
            qmin=self.emin,
            emin=self.emin,
            subnormals=False,
            pos_limit=self.max,
            neg_limit=self.max,
            saturate=True,
            has_inf=False,
            unsigned_zero=True,
            code_parity=False,
        )


TENSOR = "tensor"  # Scaled.block: one scale for the whole tensor


def _check_block(block, axis) -> None:
    if block is None or block == TENSOR:
        return
    if isinstance(block, tuple):
        if len(block) != 2:
            raise ValueError(f"Scaled.block as a tuple must be (rows, cols), got {block!r}")
        for name, n in zip(("rows", "cols"), block):
            check_int_field("Scaled", f"block {name}", n, 1, 2**31)
        if axis != -1:
            raise ValueError(
                "Scaled.block (rows, cols) tiles the last two dimensions; axis must be -1, got "
                f"{axis}"
            )
        return
    if isinstance(block, str):
        raise ValueError(f"Scaled.block as a string must be {TENSOR!r}, got {block!r}")
    check_int_field("Scaled", "block", block, 1, 2**31)


@dataclass(frozen=True, repr=False)
class Scaled:
    """A scaled format: ``element`` values times a ``scale`` shared by each block.

    Args:
        element: the element format, a Float or Fixed (elements always saturate; see the module
            docstring).
        scale: PowerOfTwo (E8M0 by default) or a Float (its sign is not used).
        block: which elements share a scale:
            an int n: blocks of n consecutive elements along ``axis`` (the last may be shorter);
            None: the whole ``axis`` (one scale per row for axis=-1, per column for axis=0);
            (rows, cols): 2-D tiles over the last two dimensions (axis must be -1; a 1-D tensor
            is one row);
            "tensor": one scale for the whole tensor.
        axis: the dimension blocks run along, torch's convention (negative counts from the end).
        scale_rule: "floor", "ceil", "even" or "rceil" for PowerOfTwo scales (default "floor"),
            "amax" for Float scales (the default and only rule there). See the module docstring.
        tensor_scale: a second, per-tensor float32 scale (NVFP4; a float64 one in a float64
            tensor, whose arithmetic is float64); Float scales only, with
            scale max * elem_max below 2**128, the scale's smallest normal at most 2 and elem_max
            at least 2, so that t, 1 / t and every block's t * s are finite float32 numbers.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range or the combination is not meaningful (a power-of-two
            rule with a Float scale and vice versa, tiles with an axis other than -1, a tensor
            scale whose float32 arithmetic would overflow).
    """

    element: Float | Fixed
    scale: PowerOfTwo | Float = field(default_factory=PowerOfTwo)
    block: int | tuple[int, int] | str | None = 32
    axis: int = field(default=-1, kw_only=True)
    scale_rule: str | None = field(default=None, kw_only=True)
    tensor_scale: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.element, (Float, Fixed)):
            raise TypeError(
                f"Scaled.element must be a Float or Fixed, got {type(self.element).__name__}"
            )
        if not isinstance(self.scale, (PowerOfTwo, Float)):
            raise TypeError(
                f"Scaled.scale must be a PowerOfTwo or Float, got {type(self.scale).__name__}"
            )
        check_int_field("Scaled", "axis", self.axis, -(2**31), 2**31 - 1)
        _check_block(self.block, self.axis)
        check_bool_field("Scaled", "tensor_scale", self.tensor_scale)
        power_of_two = isinstance(self.scale, PowerOfTwo)
        if self.scale_rule is None:
            object.__setattr__(self, "scale_rule", "floor" if power_of_two else "amax")
        allowed = POWER_OF_TWO_RULES if power_of_two else ("amax",)
        if self.scale_rule not in allowed:
            raise ValueError(
                f"Scaled.scale_rule must be one of {allowed} with a {type(self.scale).__name__} "
                f"scale, got {self.scale_rule!r}"
            )
        if self.tensor_scale and power_of_two:
            raise ValueError("Scaled.tensor_scale needs a Float scale (NVFP4's E4M3)")
        if isinstance(self.scale, Float) and (
            self.scale.emax > 127 or self.scale.emin - self.scale.man < -149
        ):
            raise ValueError(f"Scaled.scale {self.scale!r} does not fit float32's range")
        if not self.element.max > 0:
            raise ValueError(f"Scaled.element {self.element!r} has no positive value")
        if self.tensor_scale:
            self._check_tensor_scale()
        if not torch.compiler.is_compiling():
            # The first equal Scaled made: what torch.compile's trace-time op arguments are keyed
            # by (see op_arguments).
            object.__setattr__(self, "_first", _FIRST.setdefault(self, self))

    def _check_tensor_scale(self) -> None:
        """The tensor scale's float32 arithmetic must stay finite: scale max * elem_max (the
        divisor of t) below 2**128, t's floor 2**-126 / (the scale's smallest normal) at least
        2**-127, so that 1 / t is finite, and elem_max at least 2, so that a block's decode factor
        t * s (about amax / elem_max) is finite."""
        top = self.scale.max * self.element.max
        if not top < 2.0**128:
            raise ValueError(
                f"Scaled.tensor_scale needs scale max * element max below 2**128 (a finite "
                f"float32), got {self.scale.max!r} * {self.element.max!r} = {top!r}"
            )
        if self.scale.emin > 1:
            raise ValueError(
                f"Scaled.tensor_scale needs a scale whose smallest normal is at most 2 (emin <= 1, "
                f"so that 1 / t stays finite in float32), got {self.scale!r} with smallest normal "
                f"2**{self.scale.emin}"
            )
        if not self.element.max >= 2:
            # A block's decode factor t * s is about amax / elem_max, and its encoder's
            # reciprocal (1 / t) / s about elem_max / amax: below 2 the first overflows the
            # arithmetic for a tensor near its largest value (and the product 0 * Inf of a
            # zero element gives NaN), far below it the second underflows to 0.
            raise ValueError(
                f"Scaled.tensor_scale needs an element max of at least 2 (so that the decode "
                f"factor t * s, about amax / elem_max, stays finite in float32 for every "
                f"tensor), got {self.element!r} with max {self.element.max!r}; an element format "
                f"with its values scaled by a power of two holds the same values"
            )

    __repr__ = short_repr
    __getstate__ = field_state

    # Facts, with numpy.finfo's names where they apply.

    @property
    def bits(self) -> int:
        """Bits per element, the scale not included."""
        return self.element.bits

    @property
    def block_elements(self) -> int | None:
        """Elements per scale, or None where it depends on the tensor's shape."""
        if isinstance(self.block, int):
            return self.block
        if isinstance(self.block, tuple):
            return self.block[0] * self.block[1]
        return None

    @property
    def bits_per_element(self) -> float | None:
        """Storage per element with the block's scale shared out (None: depends on the shape)."""
        n = self.block_elements
        return None if n is None else self.bits + self.scale.bits / n

    @property
    def element_max(self) -> float:
        """The largest positive element, elem_max."""
        return self.element.max

    @property
    def element_emax(self) -> int:
        """floor(log2(elem_max)), the emax of the power-of-two rules."""
        return math.frexp(self.element.max)[1] - 1

    @property
    def element_precision(self) -> int:
        """Fraction bits of the element's largest binade (what "even" rounds amax to)."""
        if isinstance(self.element, Float):
            return self.element.man
        return self.element.fl + self.element_emax

    @property
    def max(self) -> float:
        """The largest value a block can decode to (tensor scale 1), elem_max * the largest
        scale."""
        return self.element.max * self.scale.max

    @property
    def eps(self) -> float:
        """The element format's eps, relative to the block's scale (for a Float element in
        which 1 is a normal value, 2**-man: the relative spacing within a block's top binade)."""
        return self.element.eps

    def saturating_element(self) -> Float | Fixed:
        """The element format as it is rounded: saturating."""
        if isinstance(self.element, Float):
            return Float(
                self.element.exp,
                self.element.man,
                bias=self.element.bias,
                subnormals=self.element.subnormals,
                special=self.element.special,
                saturate=True,
            )
        return Fixed(
            self.element.wl,
            self.element.fl,
            signed=self.element.signed,
            clamp=True,
            symmetric=self.element.symmetric,
        )

    def _misfit(self, container) -> str | None:
        """Why a tensor of ``container`` cannot be quantised into this format (its elements do
        not fit it), or None: the decoded values are rounded into the tensor's own dtype."""
        return self.element._misfit(container)

    def op_arguments(self, dtype: torch.dtype) -> tuple:
        """The compiled quantize_scaled op's arguments between x and the rounding rule, for a
        tensor of ``dtype`` (computed once per dtype).

        While torch.compile traces, the arguments of a Scaled made outside the trace are
        computed at trace time and enter the graph as constants, keyed by the first equal Scaled
        (whose identity dynamo guards on): read through the fields, a field that changed between
        two traces of one function (mxfp8_e4m3, then mxfp6_e3m2) was a symbolic value, which the
        Fractions of the element's max could not take (dynamo refused the second call).

        Raises:
            ValueError: the element format does not fit ``dtype``.
        """
        first = self.__dict__.get("_first") if torch.compiler.is_compiling() else None
        if first is not None:
            check_fits(self.element, dtype)
            return _constant_op_arguments(first, dtype)
        return self._computed_op_arguments(dtype)

    def _computed_op_arguments(self, dtype: torch.dtype) -> tuple:
        """op_arguments(dtype), computed once per dtype (stored outside torch.compile's traces)."""
        stored = self.__dict__.get("_op_arguments")
        if stored is None:
            stored = {}
            if not torch.compiler.is_compiling():
                object.__setattr__(self, "_op_arguments", stored)  # frozen: a cache, not a field
        arguments = stored.get(dtype)
        if arguments is None:
            check_fits(self.element, dtype)
            block, axis = self.block_arguments()
            arguments = (
                *self.saturating_element().grid(),
                *self.scale.grid(),
                SCALE_RULES.index(self.scale_rule),
                self.tensor_scale,
                self.element_emax,
                self.element_precision,
                self.element.max,
                block,
                axis,
            )
            if not torch.compiler.is_compiling():
                stored[dtype] = arguments
        return arguments

    def block_arguments(self) -> tuple[list[int], int | None]:
        """(block, axis) as the compiled op takes them: ([n], axis) blocks of n along axis,
        ([], axis) the whole axis, ([rows, cols], None) tiles of the last two dimensions,
        ([], None) the whole tensor."""
        if self.block == TENSOR:
            return [], None
        if self.block is None:
            return [], self.axis
        if isinstance(self.block, tuple):
            return list(self.block), None
        return [self.block], self.axis


_FIRST: dict = {}


@torch.compiler.assume_constant_result
def _constant_op_arguments(fmt: Scaled, dtype: torch.dtype) -> tuple:
    """fmt.op_arguments(dtype), which dynamo computes at trace time and holds as a constant."""
    return fmt._computed_op_arguments(dtype)


def _mx(element: Float | Fixed) -> Scaled:
    return Scaled(element, PowerOfTwo(8), 32)


_E4M3 = Float(4, 3, special="fn", saturate=True)
_E5M2 = Float(5, 2, saturate=True)
_FLOAT32 = Float(8, 23)

SCALED_PRESETS: dict[str, Scaled] = {
    # OCP Microscaling Formats (MX) v1.0: 32 elements share an E8M0 scale, OCP's floor rule.
    "mxfp8_e4m3": _mx(_E4M3),
    "mxfp8_e5m2": _mx(_E5M2),
    "mxfp6_e3m2": _mx(Float(3, 2, special="none", saturate=True)),
    "mxfp6_e2m3": _mx(Float(2, 3, special="none", saturate=True)),
    "mxfp4_e2m1": _mx(Float(2, 1, special="none", saturate=True)),
    "mxint8": _mx(Fixed(8, 6)),  # two's complement with 6 fraction bits: [-2, 127/64]
    # NVIDIA NVFP4: E2M1 elements, an E4M3 scale per 16, and a float32 scale per tensor.
    "nvfp4": Scaled(Float(2, 1, special="none", saturate=True), _E4M3, 16, tensor_scale=True),
    # FP8 with float32 scales from the block's amax: DeepSeek-V3's 1x128 (activations) and
    # 128x128 (weights) tiles, and per-tensor and per-row current scaling.
    "fp8_e4m3_1x128": Scaled(_E4M3, _FLOAT32, 128),
    "fp8_e4m3_128x128": Scaled(_E4M3, _FLOAT32, (128, 128)),
    "fp8_e4m3_tensor": Scaled(_E4M3, _FLOAT32, TENSOR),
    "fp8_e5m2_tensor": Scaled(_E5M2, _FLOAT32, TENSOR),
    "fp8_e4m3_row": Scaled(_E4M3, _FLOAT32, None),
    "fp8_e5m2_row": Scaled(_E5M2, _FLOAT32, None),
}


def preset(name: str) -> Scaled:
    """The scaled preset called ``name`` (see SCALED_PRESETS).

    Raises:
        TypeError: name is not a str.
        ValueError: no scaled preset has that name; the message lists them.
    """
    if not isinstance(name, str):  # an unhashable one raised "unhashable type" from the dict
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    try:
        return SCALED_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"no scaled preset named {name!r}; scaled presets: {', '.join(SCALED_PRESETS)}"
        ) from None

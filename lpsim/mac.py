"""MAC: the arithmetic of a simulated matrix product, described in full.

A matrix product c = a @ b adds, for each result c[i, j], the K products a[i, k] b[k, j]. Real
hardware does not add them exactly: the products may be rounded, every partial sum is rounded into
an accumulator of limited precision, and the order of the additions (one after another, in chunks,
as a tree) decides which roundings happen. A ``MAC`` (multiply-accumulate) states each of these
choices, so that a simulated product is reproducible from its description alone:

    >>> import lpsim
    >>> mac = lpsim.MAC(accumulator=lpsim.Float(5, 10))                     # float16 accumulator
    >>> mac.fused, mac.order
    (True, 'sequential')
    >>> lpsim.MAC(accumulator=lpsim.Float(8, 7), order="chunked", chunk=32,
    ...           chunk_accumulator=lpsim.Float(5, 10)).chunk
    32

What each field means (terms t_k are the products in increasing k; ``round`` rounds an exact value
once, by ``rounding``, onto the named format's grid):

- ``product``: None for exact products, each added by a fused multiply-add (the sum
  s + a[i, k] b[k, j] is rounded once); a format for a separate multiplier, whose products
  t_k = round_product(a[i, k] b[k, j]) are rounded before they are added. The separate
  multiply-and-add of an IEEE unit of the accumulator's own format is ``product=accumulator``.
- ``accumulator``: the format every partial sum is rounded into. None is torch's own float32
  product (torch.matmul), whose order of additions is the library's and unspecified: the fast
  path, and the default.
- ``order``:
  - ``"sequential"``: s = round(t_0), then s = round(s + t_k) for k = 1, ..., K - 1;
  - ``"chunked"``: the terms in consecutive chunks of ``chunk``, each chunk summed sequentially
    in ``chunk_accumulator`` (default: the accumulator), and each chunk's sum u added into the
    accumulator: s = round(u_0), then s = round(s + u_c);
  - ``"pairwise"``: a binary tree: the sum of terms [lo, hi) with n = hi - lo >= 2 terms is
    round(left + right), with the left part the first 2^m terms, 2^m the largest power of two
    below n; a single term is itself (rounded when it is the whole sum).
- ``compensated``: Kahan's compensated summation in the accumulator (sequential order only): a
  running compensation c carries the low part each addition lost, every operation rounded into the
  accumulator: y = round(t_k - c), u = round(s + y), c = round(round(u - s) - y), s = u. c takes
  both signs, so the accumulator must be signed (an unsigned Fixed or P3109 format is refused).
- ``rounding``, ``rbits``: the rule of every rounding, and the random bits of a stochastic rule.

``matmul(a, b, mac)`` computes a product under a MAC (CPU or CUDA; exact products need float32,
bfloat16 or float16 operands):

    >>> import torch
    >>> ones = torch.ones(1, 4096)
    >>> lpsim.mac.matmul(ones, ones.t(), lpsim.MAC(accumulator=lpsim.Float(5, 10))).item()
    2048.0
    >>> lpsim.mac.matmul(ones, ones.t(), lpsim.MAC(accumulator=lpsim.Float(5, 10),
    ...                                            order="pairwise")).item()
    4096.0

- ``tensor_core``: a ``TensorCore``, the multi-term adder of a GPU's matrix unit: the products are
  taken ``group`` at a time (exact, ``product`` None), each group and the running value c (+0 at
  the start) aligned to their largest exponent, truncated, added exactly and normalised once into
  the accumulator by the tensor core's own rule; the result is c for the next group. With
  ``order="sequential"`` the whole sum is one such chain in ``accumulator``, which rounds by the
  tensor core's rule alone (``rounding`` stays "nearest": another would round nothing); with
  ``order="chunked"`` each chunk (a multiple of ``group`` terms) is a chain in
  ``chunk_accumulator``, whose result is added into ``accumulator`` by ``rounding``: the
  promotion of a partial sum into float32 every ``chunk`` products. ``TensorCore`` defines the
  step; ``PRESETS`` holds the published models of NVIDIA's tensor cores:

    >>> tc = lpsim.mac.preset("H100/bf16")
    >>> tc.tensor_core.group, tc.tensor_core.fraction_bits, tc.accumulator
    (16, 25, Float(exp=8, man=23))
    >>> x = torch.tensor([[1.0] + [2.0**-24] * 15], dtype=torch.bfloat16)
    >>> lpsim.mac.matmul(x, x.t(), tc).item()        # the 2^-48 products fall below 2^(0 - 25)
    1.0

Random words: with a stochastic rule, rounding j of term k of result r (results numbered in
row-major order over the result's M x N entries) draws word ``8 (r K + k) + j`` of the
position-keyed stream of (seed, offset), with j = 0 for the product's rounding; 1 for the
addition that brings term k in (sequential: into s; chunked: into its chunk's sum; pairwise: the
tree node whose right part starts at k, or term 0 when K = 1); 2 for the addition of the chunk
that ends at term k into the accumulator; and, in Kahan's summation, 3 for y, 4 for u - s and 5 for
c (1 is u). A tensor core's normalisation of the group that ends at term k draws word 1 of that
term (by its own rule, with ``rbits``), and a chunk's promotion word 2 of its last term.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from lpsim._checks import (
    check_choice,
    check_element_format,
    check_int,
    check_strided,
    check_tensor,
)
from lpsim._checks import random_args as _random_args
from lpsim._ops import call
from lpsim.accumulate import check_product_operands
from lpsim.formats import Fixed, Float, check_fits, sum_container
from lpsim.functional import quantize
from lpsim.rounding import Rounding, check_rbits
from lpsim.update import own_format, sum_grid

__all__ = [
    "MAC",
    "ORDERS",
    "PRESETS",
    "TensorCore",
    "WORDS_PER_TERM",
    "matmul",
    "preset",
]

ORDERS = ("sequential", "chunked", "pairwise")
WORDS_PER_TERM = 8  # random words reserved per term and result (see the module docstring)
MAX_CHUNK = 2**31 - 1

Order = Literal["sequential", "chunked", "pairwise"]

MAX_GROUP = 128  # products per tensor-core step (the compiled core's buffer)
MAX_FRACTION_BITS = 52  # a group's aligned sum fits an int64
MAX_EXPONENT_FLOOR = 1000
BINARY32_EMIN = -126  # c is held as a binary32 value: its subnormals align by exponent -126


@dataclass(frozen=True)
class TensorCore:
    """One step of a tensor core's multi-term adder: ``group`` exact products and the incoming
    value c, aligned to their largest exponent, truncated, added exactly and normalised once.

    A step, with p_1, ..., p_n the group's nonzero products and c the running value:

    1. exponents: a product a b is aligned by e_a + e_b, the exponents of its operands (the
       exponent of x is floor(log2 |x|), or ``operands.emin`` for a subnormal of the operand
       format): the product is not renormalised, so its magnitude lies in [0, 4) 2^(e_a + e_b).
       A nonzero c is aligned by its binary32 exponent, max(floor(log2 |c|), -126). Zero products
       and c = 0 take no part.
    2. E = the largest of these exponents, and at least ``exponent_floor`` when given.
    3. every term, c included, is truncated toward zero to a multiple of 2^(E - fraction_bits);
       the truncated terms are added exactly (the hardware's carry bits hold the sum).
    4. the sum is rounded once onto the accumulator by ``normalise`` (+0 when it is exactly 0);
       the result is c for the next group.

    A NaN product or c, or +Inf meeting -Inf, gives NaN; else an Inf among them gives that Inf.

    Args:
        group: products per step, in [1, 128].
        fraction_bits: F, the bits kept below the largest exponent, in [0, 52] (23 plus the extra
            alignment bits of the paper's models).
        exponent_floor: the smallest E, in [-1000, 1000]; None: no floor.
        normalise: the rounding of a group's sum onto the accumulator (a rule or its name;
            "toward_zero" on the GPUs modelled, "nearest" for their float16 outputs).
        operands: the format of a and b, whose emin is the exponent of their subnormals (a Float
            that float64 holds); None: the format of the tensors' dtype. Every finite value of
            a and b must be a value of it (lpsim.mac.matmul refuses others: the hardware never
            sees them); operands=None aligns each operand by its own exponent, for operands
            that carry a scale.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range (the message names it and its range).
    """

    group: int
    fraction_bits: int
    exponent_floor: int | None = None
    normalise: Rounding | str = "toward_zero"
    operands: Float | None = None

    def __post_init__(self) -> None:
        check_int("group", self.group, 1, MAX_GROUP)
        check_int("fraction_bits", self.fraction_bits, 0, MAX_FRACTION_BITS)
        if self.exponent_floor is not None:
            check_int(
                "exponent_floor", self.exponent_floor, -MAX_EXPONENT_FLOOR, MAX_EXPONENT_FLOOR
            )
        object.__setattr__(self, "normalise", Rounding.parse(self.normalise, "normalise"))
        if self.operands is not None:
            if not isinstance(self.operands, Float):
                raise TypeError(
                    f"operands must be a Float format or None, got {type(self.operands).__name__}"
                )
            check_fits(self.operands, torch.float64)

    def operand_emin(self, dtype: torch.dtype) -> int:
        """The exponent of the operands' subnormals for operands stored in ``dtype``."""
        return (self.operands or own_format(dtype)).emin


@dataclass(frozen=True)
class MAC:
    """How a matrix product multiplies and adds (the module docstring defines every field).

    Args:
        accumulator: the format of the partial sums (a Float, Fixed or P3109); None: torch's own
            float32 product, in an unspecified order.
        product: the format each product is rounded into before it is added; None: exact products
            (fused multiply-add).
        rounding: the rule of every rounding ("nearest" by default); with a tensor core, of a
            chunked one's promotions (a sequential one's groups round by its normalise).
        rbits: random bits of a stochastic rule, in [1, 32]; None: 32.
        order: "sequential", "chunked" or "pairwise".
        chunk: the terms per chunk, in [1, 2^31 - 1]; required by, and only for, "chunked".
        chunk_accumulator: the format of a chunk's sum ("chunked" only); None: the accumulator.
        compensated: Kahan's compensated summation ("sequential" only; a signed accumulator).
        tensor_core: a TensorCore that adds the products in groups ("sequential" or "chunked",
            exact products, no Kahan); None: one product at a time.

    Raises:
        TypeError: a format is not a Float, Fixed or P3109; chunk or rbits is not an int; rounding
            is not a rule.
        ValueError: a value is out of range, or a field is given that the order (or the native
            accumulator) does not use.
    """

    accumulator: Float | Fixed | None = None
    product: Float | Fixed | None = None
    rounding: Rounding | str = "nearest"
    rbits: int | None = None
    order: Order = "sequential"
    chunk: int | None = None
    chunk_accumulator: Float | Fixed | None = None
    compensated: bool = False
    tensor_core: TensorCore | None = None

    def __post_init__(self) -> None:
        check_element_format("accumulator", self.accumulator)
        check_element_format("product", self.product)
        check_element_format("chunk_accumulator", self.chunk_accumulator)
        rule = Rounding.parse(self.rounding)
        object.__setattr__(self, "rounding", rule)
        core = self.tensor_core
        if core is not None and not isinstance(core, TensorCore):
            raise TypeError(f"tensor_core must be a TensorCore or None, got {type(core).__name__}")
        if self.rbits is not None and core is not None and not self.drawing_rule.is_stochastic:
            raise ValueError(
                "rbits applies to a stochastic rule: with a tensor core, its normalise "
                f"({core.normalise.name!r}) or the MAC's rounding ({rule.name!r}), neither of "
                "which is stochastic here"
            )
        check_rbits(self.rbits, self.drawing_rule)
        check_choice("order", self.order, ORDERS)
        if not isinstance(self.compensated, bool):
            raise TypeError(f"compensated must be a bool, got {type(self.compensated).__name__}")
        if self.order == "chunked":
            if self.chunk is None:
                raise ValueError('order="chunked" needs chunk, the number of terms per chunk')
            check_int("chunk", self.chunk, 1, MAX_CHUNK)
        elif self.chunk is not None or self.chunk_accumulator is not None:
            raise ValueError(
                f'chunk and chunk_accumulator apply to order="chunked" only, not {self.order!r}'
            )
        if self.compensated and self.order != "sequential":
            raise ValueError(
                f'compensated (Kahan) summation applies to order="sequential" only, not '
                f"{self.order!r}"
            )
        acc = self.accumulator
        if self.compensated and not getattr(acc, "signed", True):  # Fixed's and P3109's
            # c = (u - s) - y is negative about as often as positive, whatever the terms' signs:
            # an unsigned accumulator would clip it to 0 (or make it NaN under SatNone).
            raise ValueError(
                "compensated (Kahan) summation keeps a signed compensation in the accumulator: "
                f"the accumulator must be a signed format with compensated=True, got {acc!r}"
            )
        customised = (
            self.product is not None
            or self.order != "sequential"
            or self.compensated
            or rule is not Rounding.nearest
        )
        if core is not None:
            self._check_tensor_core(core)
        if self.accumulator is None and customised:
            raise ValueError(
                "accumulator=None is torch's own float32 product, which takes no other field: "
                "give the accumulator format to set product, order, compensated or rounding"
            )

    def _check_tensor_core(self, core: TensorCore) -> None:
        if self.accumulator is None:
            raise ValueError("a tensor core needs the accumulator format its groups round into")
        if self.product is not None:
            raise ValueError("a tensor core forms its products exactly: product must be None")
        if self.compensated:
            raise ValueError("a tensor core does not compensate: compensated must be False")
        if self.order == "pairwise":
            raise ValueError(
                'a tensor core chains its groups: order must be "sequential" or "chunked", '
                'not "pairwise"'
            )
        if self.order == "sequential" and self.rounding is not Rounding.nearest:
            # No sum of a sequential chain takes the MAC's rule: each group rounds by normalise.
            raise ValueError(
                "a sequential tensor core rounds every group by its normalise and no other sum "
                "by rounding, which applies to a chunked one's promotion only: leave rounding "
                f"at 'nearest' (got {self.rounding.name!r}) and set the groups' rule as "
                "TensorCore(normalise=...)"
            )
        if self.order == "chunked" and self.chunk % core.group:
            raise ValueError(
                f"chunk must be a multiple of the tensor core's group ({core.group}), "
                f"got {self.chunk}"
            )
        for name in ("accumulator", "chunk_accumulator"):
            fmt = getattr(self, name)
            if fmt is None:
                continue
            problem = None if isinstance(fmt, Float) else f"{fmt!r} is not a Float"
            if problem is None:
                try:
                    check_fits(fmt, torch.float32)
                except ValueError as error:
                    problem = str(error)
            if problem is not None:
                raise ValueError(
                    f"a tensor core's {name} must be a Float whose values are binary32 values "
                    f"(it is held as one, its subnormals aligned by exponent -126): {problem}"
                )

    @property
    def drawing_rule(self) -> Rounding:
        """The rule that decides whether random words are drawn: a stochastic tensor-core
        normalisation if there is one, else ``rounding``."""
        core = self.tensor_core
        if core is not None and core.normalise.is_stochastic:
            return core.normalise
        return self.rounding

    @property
    def fused(self) -> bool:
        """Whether each product is added by a fused multiply-add (exact products)."""
        return self.product is None

    @property
    def native(self) -> bool:
        """Whether this is torch's own float32 product (accumulator None)."""
        return self.accumulator is None

    def for_eval(self, eval_rounding: Rounding | None) -> MAC:
        """The MAC an evaluating module uses: its stochastic rules (the MAC's, a tensor core's
        normalisation) replaced by ``eval_rounding`` (None keeps them)."""
        if eval_rounding is None or self.native or not self.drawing_rule.is_stochastic:
            return self
        core = self.tensor_core
        if core is not None and core.normalise.is_stochastic:
            core = dataclasses.replace(core, normalise=eval_rounding)
        rounding = eval_rounding if self.rounding.is_stochastic else self.rounding
        return dataclasses.replace(self, rounding=rounding, rbits=None, tensor_core=core)

    def __str__(self) -> str:
        """A one-line summary: the accumulator, the rule, then what differs from a fused
        sequential sum ("Float(exp=8, man=7) nearest, chunk 32 in Float(exp=5, man=10)")."""
        if self.native:
            return "torch float32"
        words = [f"{self.accumulator!r} {self.rounding.name}"]
        if self.rbits is not None:
            words[0] += f" rbits={self.rbits}"
        if self.product is not None:
            words.append(f"products {self.product!r}")
        if self.order == "chunked":
            inner = f" in {self.chunk_accumulator!r}" if self.chunk_accumulator is not None else ""
            words.append(f"chunk {self.chunk}{inner}")
        elif self.order == "pairwise":
            words.append("pairwise")
        if self.compensated:
            words.append("Kahan")
        core = self.tensor_core
        if core is not None:
            floor = f", floor {core.exponent_floor}" if core.exponent_floor is not None else ""
            words.append(
                f"tensor core: groups of {core.group}, {core.fraction_bits} fraction bits"
                f"{floor}, {core.normalise.name}"
            )
        return ", ".join(words)


ORDER_CODES = {order: code for code, order in enumerate(ORDERS)}  # the op's MacOrder values


def matmul(
    a: torch.Tensor, b: torch.Tensor, mac: MAC, *, seed: int | None = None, offset: int = 0
) -> torch.Tensor:
    """c = a @ b with every result summed as ``mac`` prescribes (the module docstring defines the
    variants and the random words).

    Args:
        a: an (M, K) float32, bfloat16 or float16 tensor, on the CPU or a CUDA device (the CUDA
            kernel gives the CPU's bits for the same seed and offset).
        b: a (K, N) tensor of a's dtype, on a's device.
        mac: the arithmetic; the native MAC() is torch.matmul itself.
        seed, offset: the random stream of a stochastic rule (seed None: drawn from torch's
            default CPU generator).

    Returns:
        c of shape (M, N): in a's dtype when the accumulator fits it, else in float32 when the
        accumulator fits that (bfloat16 or float16 operands, a float32 accumulator), else in
        float64 (an accumulator wider than float32, Float(11, 52) say, or a Fixed without clamp,
        whose sums may leave its range on a grid that no narrower tensor holds).

    Under torch.autocast the native MAC is torch.matmul as autocast runs it (its operands cast to
    the autocast dtype); a non-native MAC takes a and b as given. lpsim.nn.functional's products
    cast their operands as autocast does before their products.

    Not differentiable under a non-native MAC: with grad mode on and an operand that requires
    grad, c carries a node that raises RuntimeError when a backward pass reaches it (rather than
    torch's zero gradient with a warning). lpsim.nn.functional.matmul is the product with
    gradients.

    Raises:
        TypeError: an operand has an unsupported dtype (float64 products would not be exact) or,
            under a non-native MAC, a sparse, nested or MKL-DNN layout; the dtypes differ, or mac
            is not a MAC; seed or offset is not an int.
        ValueError: the shapes do not match, or the operands are not on one CPU or CUDA device;
            a tensor core's ``operands`` format does not hold every finite value of a or b;
            seed or offset is outside [0, 2**64) (under every MAC, the native one included,
            although a MAC that draws no random words ignores them).

    Under torch.export a non-native MAC's product is an op of the exported program, which draws
    a stochastic rule's missing seed at each call as eager calls do; a tensor core's check of
    its operands becomes an assertion of the program, which raises RuntimeError when a call's
    operands hold values that are not values of the ``operands`` format.
    """
    return seeded_matmul(a, b, mac, seed, offset)


def seeded_matmul(
    a: torch.Tensor, b: torch.Tensor, mac: MAC, seed: int | torch.Tensor | None, offset: int
) -> torch.Tensor:
    """matmul(a, b, mac, seed=seed, offset=offset), whose seed may also be a 0-d int64 tensor
    holding a seed drawn from torch's generator (lpsim._checks.draw_seed): lpsim.nn.functional
    draws one so while torch.export traces, so that the exported program draws it at each call
    (int() of it would make the trace's seed a constant of the program, which export refuses)."""
    if not isinstance(mac, MAC):
        raise TypeError(f"mac must be a MAC, got {type(mac).__name__}")
    if not mac.native:  # before the shapes: a nested tensor has none
        for name, operand in (("a", a), ("b", b)):
            check_tensor(operand, name)
            check_strided(operand, name, "lpsim.mac.matmul under a non-native MAC")
    check_product_operands(a, b, ("a", "b"), "lpsim.mac.matmul", ("cpu", "cuda"))
    # Checked under every MAC: one that draws no random words ignores seed and offset, but not
    # malformed ones (as quantize).
    drawn = isinstance(seed, torch.Tensor)  # (0 stands for it in the checks: no second draw)
    _, rbits, seed_bits, offset_bits = _random_args(
        mac.drawing_rule, mac.rbits, 0 if drawn else seed, offset
    )
    if drawn and seed_bits is not None:
        seed_bits = seed
    if mac.native:
        return torch.matmul(a, b)
    for fmt in (mac.accumulator, mac.product, mac.chunk_accumulator):
        if fmt is not None:
            check_fits(fmt, torch.float64)
    core = mac.tensor_core
    if core is not None and core.operands is not None:
        for name, operand in (("a", a), ("b", b)):
            _check_holds(operand, core.operands, name)
    out_dtype = sum_container(mac.accumulator, a.dtype)
    acc = sum_grid(mac.accumulator, out_dtype)
    inner = sum_grid(mac.chunk_accumulator or mac.accumulator, torch.float64)
    product = sum_grid(mac.product, torch.float64) if mac.product is not None else acc
    y = call(
        "mac_matmul",
        a.contiguous(),
        b.t().contiguous(),
        ORDER_CODES[mac.order],
        mac.chunk or 1,
        mac.compensated,
        mac.product is not None,
        core.group if core is not None else 0,
        core.fraction_bits if core is not None else 0,
        core.exponent_floor if core is not None else None,
        core.operand_emin(a.dtype) if core is not None else 0,
        int(core.normalise) if core is not None else 0,
        *product,
        *inner,
        *acc,
        int(mac.rounding),
        rbits,
        seed_bits,
        offset_bits,
    )
    return call("to_container", y, out_dtype)


def _check_holds(operand: torch.Tensor, fmt: Float, name: str) -> None:
    """Refuse an operand of a tensor core whose finite values are not all values of its
    ``operands`` format: the model aligns each operand by the format's exponents, and the
    hardware it models never sees a wider value, so its result would be no GPU's."""
    message = (
        f"lpsim.mac.matmul: {name} holds values that are not {fmt!r} values, the tensor "
        f"core's operands: round them first (lpsim.quantize({name}, {fmt!r}), or an input, "
        "weight or error format of that format), or give the TensorCore operands=None to "
        "align each operand by its own exponent"
    )
    if torch.compiler.is_exporting():
        # The values are the program's inputs: the check is an assertion of the program, made
        # at each call (a Python branch on them would be the trace's alone, which export refuses).
        finite = torch.where(torch.isfinite(operand), operand, 0).double()
        torch._assert_async((quantize(finite, fmt, "nearest") == finite).all(), message)
        return
    finite = operand[torch.isfinite(operand)].double()  # exact, and a container fmt fits
    if not torch.equal(quantize(finite, fmt, "nearest"), finite):
        raise ValueError(message)


# ---- Presets: the published models of NVIDIA's tensor cores (docs/accumulation.md cites each).

_FLOAT32 = Float(8, 23)
_OPERANDS = {
    "fp16": Float(5, 10),
    "bf16": Float(8, 7),
    "tf32": Float(8, 10),
    "e4m3": Float(4, 3, special="fn"),
    "e5m2": Float(5, 2),
}
# (GPU, operands) -> (group, fraction_bits, exponent_floor), float32 output, toward zero.
_MODELS = {
    ("V100", "fp16"): (4, 23, None),
    ("A100", "fp16"): (8, 24, -132),
    ("A100", "bf16"): (8, 24, -132),
    ("A100", "tf32"): (4, 24, -132),
    ("H100", "fp16"): (16, 25, -133),
    ("H100", "bf16"): (16, 25, -133),
    ("H100", "tf32"): (8, 25, -133),
    ("H100", "e4m3"): (32, 13, -133),
    ("H100", "e5m2"): (32, 13, -133),
    ("B200", "fp16"): (16, 25, -133),
    ("B200", "bf16"): (16, 25, -133),
    ("B200", "tf32"): (8, 25, -133),
    ("B200", "e4m3"): (32, 25, -133),
    ("B200", "e5m2"): (32, 25, -133),
}
# float16 output (fp16 operands): the groups round to nearest into float16, with their own floor.
_FLOAT16_OUTPUT_FLOORS = {"V100": -19, "A100": -20, "H100": -21, "B200": -21}
# H100's fp8 groups keep 13 fraction bits: the running value is an e8m13 number.
_H100_FP8_ACCUMULATOR = Float(8, 13)


def _tensor_core_mac(gpu: str, operands: str) -> MAC:
    group, fraction_bits, floor = _MODELS[gpu, operands]
    core = TensorCore(group, fraction_bits, floor, "toward_zero", _OPERANDS[operands])
    narrow = gpu == "H100" and operands in ("e4m3", "e5m2")
    return MAC(accumulator=_H100_FP8_ACCUMULATOR if narrow else _FLOAT32, tensor_core=core)


def _float16_output_mac(gpu: str) -> MAC:
    group, fraction_bits, _ = _MODELS[gpu, "fp16"]
    floor = _FLOAT16_OUTPUT_FLOORS[gpu]
    core = TensorCore(group, fraction_bits, floor, "nearest", _OPERANDS["fp16"])
    return MAC(accumulator=Float(5, 10), tensor_core=core)


PRESETS: dict[str, MAC] = {
    f"{gpu}/{operands}": _tensor_core_mac(gpu, operands) for gpu, operands in _MODELS
}
PRESETS.update({f"{gpu}/fp16/fp16": _float16_output_mac(gpu) for gpu in _FLOAT16_OUTPUT_FLOORS})
# DeepSeek-V3's FP8 GEMM (arXiv:2412.19437, section 3.3.2): H100 e4m3 tensor-core accumulation,
# promoted into float32 (round to nearest) every 128 products.
PRESETS["DeepSeek-V3"] = MAC(
    accumulator=_FLOAT32,
    order="chunked",
    chunk=128,
    chunk_accumulator=_H100_FP8_ACCUMULATOR,
    tensor_core=PRESETS["H100/e4m3"].tensor_core,
)


def preset(name: str) -> MAC:
    """The MAC of a published tensor-core model: ``"GPU/operands"`` with float32 output
    (GPU V100, A100, H100 or B200; operands fp16, bf16, tf32, e4m3 or e5m2, as the GPU supports),
    ``"GPU/fp16/fp16"`` with float16 output, or ``"DeepSeek-V3"``. ``PRESETS`` lists them all;
    docs/accumulation.md gives each one's source.

    The operands are passed as float32, bfloat16 or float16 tensors holding values of the named
    format: tf32 values are float32 values with 10 fraction bits, fp8 values (e4m3 as OCP's
    E4M3, e5m2) are carried in float32, bfloat16 or float16 tensors. Round them first, e.g. with
    ``lpsim.quantize(x, lpsim.Float(8, 10))``: lpsim.mac.matmul refuses other finite values.

    Raises:
        ValueError: no preset has that name (the message lists them).
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"no tensor-core preset {name!r}; the presets are {sorted(PRESETS)}"
        ) from None

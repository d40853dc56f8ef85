"""Updates: sums computed exactly and rounded once into a format (sr_add and its fused forms).

``sr_add(a, b, fmt, rounding)`` returns the exact sum a + b rounded into ``fmt`` by ``rounding``, in
a tensor of a's dtype: one kernel computes the sum with integer arithmetic (no intermediate
rounding at all) and rounds it with the same core as ``lpsim.quantize``. With the default
``rounding="stochastic"`` an update far smaller than half a spacing of the weights still moves
them with the right probability, so bfloat16 weights keep learning without a float32 master copy.
``sr_addcmul_`` and ``sr_addcdiv_`` fuse the update term of an optimizer step into the same pass.

    >>> import torch, lpsim
    >>> w = torch.ones(8, dtype=torch.bfloat16)
    >>> (w + 1e-3).tolist()                     # round to nearest: the update vanishes
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    >>> lpsim.sr_add(w, 1e-3, seed=0).tolist()  # 1 + 2**-7 with probability 1e-3 / 2**-7
    [1.0, 1.0078125, 1.0, 1.0, 1.0078125, 1.0, 1.0, 1.0]
    >>> lpsim.sr_add(torch.ones(100000, dtype=torch.bfloat16), 1e-3, seed=0).double().mean()
    tensor(1.0010, dtype=torch.float64)

Exactly representable sums are returned unchanged by every rule. ``rounding="stochastic"`` ("mode
1") rounds up with probability proportional to the distance from the value below, so the result
is unbiased: E[sr_add(a, b)] = a + b. ``"stochastic_equal"`` ("mode 2") moves an inexact sum up or
down with probability 1/2 and is biased. Any other lpsim rule may be given (``"nearest"`` gives
IEEE 754 addition in the format).

Randomness. ``randomness="position"`` (the default) draws each element's word from Philox keyed by
(seed, offset) and the element's row-major position, as ``lpsim.quantize`` does.
``randomness="value"`` keys the word by (seed, offset) and the two operands' values instead, so
equal operands round the same way wherever they sit: the result is invariant under any
permutation, layout or partition of the elements. See docs/stochastic-rounding.md for the
trade-offs.
"""

from __future__ import annotations

import functools
import math

import torch

from lpsim._checks import (
    RANDOMNESS,
    as_float64,
    check_container,
    check_element_format,
    check_factor,
    check_randomness,
    check_strided,
    random_args,
)
from lpsim._ops import call, call_in_place
from lpsim.formats import CONTAINERS, BlockFloat, Fixed, Float, GridSpec, check_fits
from lpsim.rounding import Rounding

__all__ = [
    "sr_add",
    "sr_add_",
    "sr_addcmul",
    "sr_addcmul_",
    "sr_addcdiv",
    "sr_addcdiv_",
    "RANDOMNESS",
    "own_format",
    "sum_grid",
]


_OWN_FORMATS = {dtype: Float(c.exp, c.man) for dtype, c in CONTAINERS.items()}


def own_format(dtype: torch.dtype) -> Float:
    """The format of the values a floating dtype holds: Float(8, 7) for bfloat16, and so on.

    Raises:
        TypeError: the dtype is not float32, float64, bfloat16 or float16.
    """
    if not isinstance(dtype, torch.dtype) or dtype not in _OWN_FORMATS:
        raise TypeError(f"dtype must be torch.float32, float64, bfloat16 or float16, got {dtype}")
    return _OWN_FORMATS[dtype]


@functools.lru_cache(maxsize=256)  # formats are frozen dataclasses; grid() costs ~25 us
def sum_grid(fmt: Float | Fixed, dtype: torch.dtype) -> GridSpec:
    """The grid a sum is rounded onto when the result is stored in ``dtype``: fmt's grid with the
    container's limits made explicit (a sum may be computed in a wider container). Only Fixed
    formats change: their precision is the container's (their values within range need at most
    wl - 1 bits), and an unclamped one continues past its range, where only the container's values
    remain and a sum beyond the largest of them overflows as in IEEE 754 (to Inf, or to that value
    for the rules that round toward zero). That value is the container's largest multiple of the
    format's spacing 2**-fl: the container's largest value itself unless the spacing is coarser
    than the container's there (float16 and Fixed(2, -14, clamp=False): 49152, not 65504)."""
    grid = fmt.grid()
    if isinstance(fmt, Fixed):
        own = own_format(dtype)
        grid = grid._replace(keep=own.man)
        if not fmt.clamp:
            top = math.ldexp(math.floor(math.ldexp(own.max, min(fmt.fl, 0))), -min(fmt.fl, 0))
            grid = grid._replace(pos_limit=top, neg_limit=top)
    return grid


def _update_args(a, fmt, rounding, rbits, seed, offset, randomness) -> tuple:
    """The op arguments after the operands: grid, rule, random spec and randomness code."""
    check_container(a, "a")
    check_strided(a, "a", "the sr_add family")
    if fmt is None:
        fmt = own_format(a.dtype)
    if isinstance(fmt, BlockFloat):
        raise TypeError(
            "fmt must be a Float, Fixed or P3109 format: a BlockFloat grid depends on the whole "
            "block, not on one sum"
        )
    check_element_format("fmt", fmt)
    check_fits(fmt, a.dtype)
    rule, *random = random_args(rounding, rbits, seed, offset, a)
    return (*sum_grid(fmt, a.dtype), int(rule), *random, check_randomness(randomness))


def _operand(a: torch.Tensor, b, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """b as the update ops take it: a tensor of a's shape and device whose dtype is ``dtype``, or
    when None a's, float32 or float64 (other dtypes are converted, exactly, to float32; a Python
    number becomes float64)."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        b = torch.tensor(as_float64(name, b), dtype=torch.float64, device=a.device)
    check_container(b, name)
    check_strided(b, name, "the sr_add family")
    if b.device != a.device:
        raise ValueError(f"{name} must be on a's device ({a.device}), got {b.device}")
    if dtype is not None:
        b = b.to(dtype)
    elif b.dtype not in (a.dtype, torch.float32, torch.float64):
        b = b.float()
    if b.shape != a.shape:
        try:
            b = b.expand(a.shape)
        except RuntimeError:
            raise ValueError(
                f"{name} of shape {tuple(b.shape)} cannot be broadcast to a's shape "
                f"{tuple(a.shape)}"
            ) from None
    return b


def sr_add(
    a: torch.Tensor,
    b: torch.Tensor | float,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    """The exact sum a + b rounded once into ``fmt``, in a new tensor of a's dtype and shape.

    Args:
        a: a float32, float64, bfloat16 or float16 tensor: the container of the result.
        b: a tensor broadcastable to a's shape, of any of those dtypes, or a Python number (taken
            as a float64). The sum uses b's exact value, whatever its precision.
        fmt: a Float, Fixed or P3109 format that fits a's dtype; None: a's own format (bfloat16
            for a bfloat16 tensor), so that the result is what an addition in that format gives.
        rounding: any lpsim rule; default "stochastic" (mode 1, unbiased). "stochastic_equal" is
            mode 2 (probability 1/2). An exactly representable sum is returned unchanged by
            every rule.
        rbits: random bits per decision, 1 to 32, for the stochastic rules (default 32).
        seed: 0 <= seed < 2**64; None: drawn from torch's default CPU generator.
        offset: 0 <= offset < 2**64: the random stream under the seed. Give each call its own.
        randomness: "position" (words keyed by the element's position) or "value" (keyed by the
            operands' values).

    Special values follow IEEE 754 addition (Inf - Inf and NaN give NaN, an exact zero sum of
    opposite operands is +0, or -0 under "down") and then the format's own rules; a finite sum
    beyond the format's range overflows as ``quantize`` does. The gradient is the identity for
    both operands.

    Raises:
        TypeError: an operand is not a strided (dense) tensor of a supported dtype, or fmt is not a
            Float, Fixed or P3109 format.
        ValueError: the format does not fit a's dtype, b cannot be broadcast, or an argument is out
            of range.
    """
    args = _update_args(a, fmt, rounding, rbits, seed, offset, randomness)
    return call("sr_add", a, _operand(a, b, "b"), *args)


def sr_add_(
    a: torch.Tensor,
    b: torch.Tensor | float,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    """a = sr_add(a, b, ...) in place; returns a. Arguments (default rounding "stochastic") and
    errors as for sr_add.

    Under autograd it behaves as torch's in-place ops: a's version counter is bumped (in
    torch.no_grad() too), so a backward that saved a's old values raises instead of using the new
    ones; outside torch.no_grad() a leaf that requires grad, or a view of one, is refused with
    RuntimeError. A non-leaf a keeps its history (the gradient through it is the identity, as for
    sr_add). No gradient reaches b: if b requires grad, a backward through a raises ("derivative
    for lpsim::sr_add_ is not implemented"); use sr_add to differentiate with respect to b.

    b may share memory with a (``sr_add_(x[1:], x[:-1])``): the sum uses b's values before the
    update, as ``x[1:] = sr_add(x[1:], x[:-1])`` does (the op reads such an operand from a copy),
    in eager mode and under torch.compile alike.
    """
    args = _update_args(a, fmt, rounding, rbits, seed, offset, randomness)
    call_in_place("sr_add_", a, _operand(a, b, "b"), *args)
    return a


def _term_dtype(a: torch.Tensor, tensor1, tensor2) -> torch.dtype:
    """The dtype torch's type promotion gives the operands of torch.addcmul(a, tensor1, tensor2):
    the promotion of the dtypes of the tensors with dimensions, or of the 0-d tensors when all are
    0-d. A Python number, as torch's wrapped numbers, never decides it (a is a floating tensor).
    For operands that pass _operand's checks it is a's dtype, float32 or float64 (bfloat16 and
    float16 promote to float32)."""
    tensors = [t for t in (a, tensor1, tensor2) if isinstance(t, torch.Tensor)]
    deciding = [t for t in tensors if t.dim() > 0] or tensors
    dtype = deciding[0].dtype
    for t in deciding[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _addc(
    a, tensor1, tensor2, value, divide, fmt, rounding, rbits, seed, offset, randomness, inplace
):
    args = _update_args(a, fmt, rounding, rbits, seed, offset, randomness)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"value must be a number, got {type(value).__name__}")
    for name, operand in (("tensor1", tensor1), ("tensor2", tensor2)):
        if isinstance(operand, torch.Tensor):  # before its dtype is promoted (float8's is not)
            check_container(operand, name)
    dtype = _term_dtype(a, tensor1, tensor2)
    t1 = _operand(a, tensor1, "tensor1", dtype)
    t2 = _operand(a, tensor2, "tensor2", dtype)
    value = _term_value(value, dtype)
    if inplace:
        call_in_place("sr_addc_", a, t1, t2, value, divide, *args)
        return a
    return call("sr_addc", a, t1, t2, value, divide, *args)


def _term_value(value: int | float, dtype: torch.dtype) -> float:
    """value as the float64 the addc ops take, checked as torch.addcmul checks it: a term computed
    in float32 (dtype other than float64) refuses a finite value beyond float32's range, which
    would become an infinite factor.

    Raises:
        ValueError: such a value, or an int beyond the float64 range.
    """
    number = as_float64("value", value)
    if dtype != torch.float64:
        where = "when the term is computed in float32, as torch.addcmul and torch.addcdiv require"
        check_factor("value", number, torch.float32, where)
    return number


_ADDC_DOC = """{summary}

    tensor1 and tensor2 are first converted to the dtype torch's type promotion gives a, tensor1 and
    tensor2 (torch.addcmul's: the tensors with dimensions decide it, 0-d tensors only when all are
    0-d, Python numbers never), which rounds a 0-d or number operand to that precision as torch
    does. The term (value * tensor1) {op} tensor2 is then computed in float64 when that dtype is
    float64, else in float32, in torch's order, each operation rounded to nearest except as follows
    (value is first rounded to that precision, as torch does; a finite value beyond float32's range,
    which would become an infinite factor there, raises ValueError, as torch refuses it); the sum of
    a and the term is then exact and rounded once, as in sr_add. With rounding "nearest" into a's
    own dtype, float32 or float64, sr_addcdiv is torch's CPU addcdiv bit for bit, on every device
    (torch's CUDA kernels group the ops otherwise; a bfloat16 or float16 sum torch rounds twice: to
    float32, then to a's dtype); torch's CPU addcmul fuses its last multiplication with the
    addition, and so does sr_addcmul: that product is exact (held in float64), so that with
    "nearest" into float32 sr_addcmul is torch's CPU addcmul bit for bit (in float64 it is rounded
    to nearest, as no wider container holds it). A NaN result is NaN in both, but its sign and
    payload may differ from torch's: an Inf - Inf sum is +NaN here (x86's default NaN, negative, in
    torch), and of a NaN a and a NaN term this keeps a's (torch on x86 the term's). tensor1 and
    tensor2 are broadcast to a's shape.
    Other arguments, among them the default rounding "stochastic", and errors as for sr_add
    (TypeError also when value is not a number, ValueError when it is beyond float32's range as
    above). Not differentiable: with grad mode on and an argument that requires grad, a backward
    pass that reaches the result raises RuntimeError. The in-place form follows torch's in-place
    rules as sr_add_ does: a non-leaf a keeps its history, and if tensor1 or tensor2 requires grad,
    a backward through a raises. tensor1 and tensor2 may share memory with a: the in-place form uses
    their values before the update.
    """


def sr_addcmul(
    a: torch.Tensor,
    tensor1: torch.Tensor | float,
    tensor2: torch.Tensor | float,
    value: float = 1.0,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    return _addc(
        a, tensor1, tensor2, value, False, fmt, rounding, rbits, seed, offset, randomness, False
    )


def sr_addcmul_(
    a: torch.Tensor,
    tensor1: torch.Tensor | float,
    tensor2: torch.Tensor | float,
    value: float = 1.0,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    return _addc(
        a, tensor1, tensor2, value, False, fmt, rounding, rbits, seed, offset, randomness, True
    )


def sr_addcdiv(
    a: torch.Tensor,
    tensor1: torch.Tensor | float,
    tensor2: torch.Tensor | float,
    value: float = 1.0,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    return _addc(
        a, tensor1, tensor2, value, True, fmt, rounding, rbits, seed, offset, randomness, False
    )


def sr_addcdiv_(
    a: torch.Tensor,
    tensor1: torch.Tensor | float,
    tensor2: torch.Tensor | float,
    value: float = 1.0,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    return _addc(
        a, tensor1, tensor2, value, True, fmt, rounding, rbits, seed, offset, randomness, True
    )


sr_addcmul.__doc__ = _ADDC_DOC.format(
    summary="a + value * tensor1 * tensor2, the sum exact and rounded once, in a new tensor.",
    op="*",
)
sr_addcmul_.__doc__ = _ADDC_DOC.format(
    summary=(
        "a = a + value * tensor1 * tensor2 in place, the sum exact and rounded once; returns a."
    ),
    op="*",
)
sr_addcdiv.__doc__ = _ADDC_DOC.format(
    summary="a + value * tensor1 / tensor2, the sum exact and rounded once, in a new tensor.",
    op="/",
)
sr_addcdiv_.__doc__ = _ADDC_DOC.format(
    summary=(
        "a = a + value * tensor1 / tensor2 in place, the sum exact and rounded once; returns a."
    ),
    op="/",
)


# Fake kernels (shapes and dtypes only). sr_add's gradient, the identity for both operands, is
# registered in C++ (csrc/autograd.cpp).


@torch.library.register_fake("lpsim::sr_add")
def _sr_add_fake(a, b, *args):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake("lpsim::sr_add_")
def _sr_add_inplace_fake(a, b, *args):
    return None


@torch.library.register_fake("lpsim::sr_addc")
def _sr_addc_fake(a, t1, t2, *args):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake("lpsim::sr_addc_")
def _sr_addc_inplace_fake(a, t1, t2, *args):
    return None

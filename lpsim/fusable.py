"""Grid rounding written in torch's elementwise integer ops, for torch.compile to fuse.

``quantize_grid_torch(x, grid, rule)`` computes what the compiled op
``torch.ops.lpsim.quantize_grid`` computes for the deterministic rules (every rule but
``stochastic`` and ``stochastic_equal``), bit for bit, in every container (float32, float64,
bfloat16, float16): it is the rounding core of csrc/include/lpsim/round.h (``round_on_grid``
without a tail) restated on the bits of x viewed as integers, with shifts, masks, comparisons and
``torch.where`` only. Inductor fuses it into the kernel that produces x, so a quantised activation
costs no extra pass over memory; the custom op is opaque to Inductor and always costs one.

``compiled_quantize`` is what ``lpsim.quantize`` calls while torch.compile traces it: the fusable
form with the straight-through gradient for Float, Fixed and P3109 formats under deterministic
rules, and None otherwise (stochastic rules, BlockFloat and Scaled formats keep the custom op: the
Philox stream, the per-block maximum and the scales have no fusable form here; so do calls under
torch.func's transforms, whose vmap dynamo cannot apply to an autograd.Function). Eager calls
keep the C++ kernel.

Integer work types: int32 for float32, int64 for float64, and int32 for bfloat16 and float16 (their
int16 views are sign-extended first, so every intermediate value fits and the result converts
back exactly). Every shift count is a constant or clamped into [0, man + 2], inside the word, where
torch's shifts are defined.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lpsim._checks import check_container, random_args, under_torch_func
from lpsim.formats import CONTAINERS, GRID_FORMATS, GridSpec, first_equal
from lpsim.rounding import Rounding

__all__ = ["quantize_grid_torch", "compiled_quantize", "compiled_quantize_", "FUSABLE_RULES"]

FUSABLE_RULES = tuple(r for r in Rounding if not r.is_stochastic)
NO_FLUSH = -(1 << 20)  # round.h's kNoFlush: a flush exponent below every exponent


class _Layout(NamedTuple):
    """How the bits of one container dtype are read: the integer view of the storage, the integer
    type the rounding works in, and the float type whose conversion finds a leading one."""

    storage: torch.dtype  # same-size integer view of the container
    work: torch.dtype  # integer type of the arithmetic (at least 32 bits)
    probe: torch.dtype  # float type that holds every significand exactly
    probe_bits: torch.dtype  # its same-size integer view
    probe_man: int  # fraction bits of the probe type
    probe_bias: int  # exponent bias of the probe type


_LAYOUTS = {
    torch.float32: _Layout(torch.int32, torch.int32, torch.float32, torch.int32, 23, 127),
    torch.float64: _Layout(torch.int64, torch.int64, torch.float64, torch.int64, 52, 1023),
    torch.bfloat16: _Layout(torch.int16, torch.int32, torch.float32, torch.int32, 23, 127),
    torch.float16: _Layout(torch.int16, torch.int32, torch.float32, torch.int32, 23, 127),
}


class _Constants(NamedTuple):
    """A grid in the bits of one container: round.h's Grid, as make_grid (grid_spec.h) builds it.
    Exponents are container-biased; the rest are container bit patterns of magnitudes."""

    man: int  # the container's fraction bits
    keep: int  # fraction bits kept below the leading one, <= man
    qmin: int  # biased exponent of the finest spacing
    flush_below: int  # without subnormals: values below 2**flush_below round to 0 or to it
    min_positive: int  # smallest positive grid value
    pos_limit: int
    neg_limit: int
    pos_overflow: int  # a finite overflow, unless the rule rounds toward zero there
    neg_overflow: int
    pos_inf: int  # what +Inf and -Inf become
    neg_inf: int
    keeps_negative_zero: bool
    code_parity: bool  # a lone leading one's parity is its exponent code's (see round.h)
    inf_bits: int
    sign_bit: int  # the sign bit as a negative number of the work type (-2**(bits-1))


def _exact_bits(value: float, exp: int, man: int) -> int:
    """Bits of a non-negative value in an IEEE container with ``exp`` and ``man`` bits.

    Raises:
        ValueError: the container does not hold the value exactly.
    """
    bias = 2 ** (exp - 1) - 1
    if value == math.inf:
        return ((1 << exp) - 1) << man
    if value == 0:
        return 0
    biased = math.frexp(value)[1] - 1 + bias  # value = m * 2**e, 0.5 <= m < 1
    if not value > 0 or biased >= (1 << exp) - 1:
        raise ValueError(f"{value!r} is not representable in the container")
    scaled = math.ldexp(value, -(max(biased, 1) - bias - man))  # in units of the container's ulp
    if scaled != math.floor(scaled):
        raise ValueError(f"{value!r} is not representable in the container")
    significand = int(scaled)
    return (biased << man) | (significand & ((1 << man) - 1)) if biased >= 1 else significand


def format_constants(fmt, dtype: torch.dtype) -> _Constants:
    """_constants(fmt.grid(), dtype), also while torch.compile traces.

    A grid stored on a format is read by dynamo through the format's attributes, so once a second
    trace sees its float fields (the limits) change (a model of the same class with another
    format), dynamo makes them symbolic floats, which _constants cannot take (and which dynamo
    refuses inside an autograd.Function). Formats store their grid when they are made (outside
    any trace), and the constants of such a format are computed by dynamo at trace time
    (_stored_format_constants). A format made inside a traced function has no stored grid, and
    its grid's fields are constants of that trace."""
    first = first_equal(fmt)
    if first is not None:  # the first equal format: equal formats share the compiled graph
        return _stored_format_constants(first, dtype)
    return _constants(fmt.grid(), dtype)


@torch.compiler.assume_constant_result
def _stored_format_constants(fmt, dtype: torch.dtype) -> _Constants:
    return _constants(fmt.grid(), dtype)


def _constants(grid: GridSpec, dtype: torch.dtype) -> _Constants:
    """grid in the bits of container ``dtype``, as make_grid in csrc/include/lpsim/grid_spec.h.

    Raises:
        ValueError: the grid's finest spacing or its limits are not representable in the container
            (formats that fit the container never raise; see lpsim.formats.check_fits).
    """
    c = CONTAINERS[dtype]
    bias = c.bias
    inf_bits = ((1 << c.exp) - 1) << c.man
    keep = c.man if grid.keep < 0 or grid.keep > c.man else grid.keep
    qmin = grid.qmin + bias
    flush_below = NO_FLUSH if grid.subnormals else grid.emin + bias
    smallest = qmin if grid.subnormals else flush_below
    if smallest < 1 - c.man or smallest >= (1 << c.exp) - 1:
        raise ValueError("the format's smallest spacing is not representable in this container")
    min_positive = smallest << c.man if smallest >= 1 else 1 << (smallest - 1 + c.man)
    pos_limit = _exact_bits(grid.pos_limit, c.exp, c.man)
    neg_limit = _exact_bits(grid.neg_limit, c.exp, c.man)
    quiet_nan = inf_bits | (1 << (c.man - 1))
    neg_inf = grid.has_inf and grid.neg_limit > 0  # no -Inf without negative values
    pos_unbounded = inf_bits if grid.has_inf else quiet_nan  # unclamped overflow
    neg_unbounded = inf_bits if neg_inf else quiet_nan
    pos_overflow = pos_limit if grid.saturate else pos_unbounded
    neg_overflow = neg_limit if grid.saturate else neg_unbounded
    work_bits = torch.iinfo(_LAYOUTS[dtype].work).bits
    return _Constants(
        man=c.man,
        keep=keep,
        qmin=qmin,
        flush_below=flush_below,
        min_positive=min_positive,
        pos_limit=pos_limit,
        neg_limit=neg_limit,
        pos_overflow=pos_overflow,
        neg_overflow=neg_overflow,
        pos_inf=inf_bits if grid.has_inf else pos_overflow,
        neg_inf=inf_bits if neg_inf else neg_overflow,
        keeps_negative_zero=not grid.unsigned_zero,
        code_parity=grid.code_parity,
        inf_bits=inf_bits,
        sign_bit=-(1 << (work_bits - 1)) if dtype in (torch.float32, torch.float64) else -(1 << 15),
    )


def _pick(condition: torch.Tensor, a: int, b: int, like: torch.Tensor) -> torch.Tensor | int:
    """condition ? a : b for Python ints a and b, as a tensor of like's type (a plain int when
    a == b, so that no tensor is made)."""
    if a == b:
        return a
    return torch.where(condition, torch.full_like(like, a), b)


def _needs_leading_one(k: _Constants) -> bool:
    """Whether rounding needs the position of the leading one of a container subnormal's
    significand (one conversion to float and one bit cast more per element). It does not when the
    grid's finest spacing is at least 2**-keep times the container's smallest normal, and a grid
    without subnormals flushes below at least twice that smallest normal: then the finest spacing
    alone sets the shift of every container subnormal, and all of them lie below 2**emin. Every
    lpsim format passes but those whose normal range reaches below the container's (e5m2fnuz in
    float16, Float(8, 1, bias=140) in float32)."""
    flush_ok = k.flush_below == NO_FLUSH or k.flush_below >= 2
    return not (k.qmin >= 1 - k.keep and flush_ok)


def quantize_grid_torch(x: torch.Tensor, grid: GridSpec, rule: Rounding) -> torch.Tensor:
    """x rounded onto ``grid`` by the deterministic ``rule``, with torch's elementwise ops only.

    Bit for bit what ``torch.ops.lpsim.quantize_grid(x, *grid, int(rule), ...)`` returns: the
    magnitude is rounded onto the grid (spacing 2**max(E - keep, qmin) in the binade
    [2**E, 2**(E+1)); without subnormals, values below 2**emin round to 0 or 2**emin), then the
    overflow policy applies (beyond the limit: the limit if the grid saturates or the rule rounds
    toward zero there, else Inf, or the quiet NaN where the grid has no Inf); +/-Inf become the
    grid's Inf, limit or NaN; NaN is returned with its payload; a zero keeps x's sign unless the
    grid has no -0. Units: x's values; grid exponents are unbiased powers of two.

    Args:
        x: a float32, float64, bfloat16 or float16 tensor, any shape and strides.
        grid: the grid (the grid() of a Float, Fixed or P3109 format); it must fit x's dtype.
        rule: any rule of FUSABLE_RULES.

    Returns:
        A tensor of x's dtype, shape and layout (the custom op's result is contiguous; the values
        are the same). Not differentiable through the integer view: see compiled_quantize.

    Raises:
        TypeError: x's dtype is not a container.
        ValueError: rule is stochastic, or the grid does not fit x's dtype.
    """
    rule = Rounding(rule)
    if rule.is_stochastic:
        raise ValueError(f"quantize_grid_torch takes the deterministic rules, not {rule.name!r}")
    check_container(x)
    return _quantize_bits(x, _constants(grid, x.dtype), rule)


def _quantize_bits(x: torch.Tensor, k: _Constants, rule: Rounding) -> torch.Tensor:
    """quantize_grid_torch(x, grid, rule) for k = _constants(grid, x.dtype), arguments checked."""
    layout = _LAYOUTS[x.dtype]
    man = k.man

    # A view with torch's negative bit (z.conj().imag) stores its values negated: its bits are
    # read from the values (torch refuses view(dtype) of it).
    u = x.resolve_neg().view(layout.storage)
    if layout.work != layout.storage:
        u = u.to(layout.work)  # sign-extended: the result converts back exactly
    negative = u < 0
    magnitude = u & (k.inf_bits | ((1 << man) - 1))
    # Inf and NaN go through the arithmetic as Inf (exact, so nothing carries) and are replaced at
    # the end; clamping keeps every intermediate value inside the work type.
    a = magnitude.clamp_max(k.inf_bits)

    # |x| = sig * 2**(eb - bias - man): the significand as an integer, subnormals included (they
    # share the quantum of eb = 1).
    field = a >> man
    eb = field.clamp_min(1)
    sig = (a & ((1 << man) - 1)) | (field.clamp_max(1) << man)

    # shift: how many low bits of sig lie below the grid's quantum, >= 0. The quantum is
    # 2**(exponent - keep), exponent being that of the leading one of sig (bit `top`), or the
    # finest spacing 2**low if coarser. top is man for normal values; for subnormals it is read
    # from the exponent of sig's exact conversion to a float (very negative for sig = 0).
    exact_top = _needs_leading_one(k)
    if exact_top:
        probe = sig.to(layout.probe).view(layout.probe_bits) >> layout.probe_man
        if layout.probe_bits != layout.work:
            probe = probe.to(layout.work)
        top = probe - layout.probe_bias
        exponent = eb + top - man
    else:
        exponent = eb
    if k.flush_below == NO_FLUSH:
        low = k.qmin
    else:
        low = _pick(exponent < k.flush_below, k.flush_below, k.qmin, eb)
    if exact_top:
        shift = torch.maximum(top - k.keep, low + man - eb)
    else:
        shift = (low + man - eb).clamp_min(man - k.keep)

    # The discarded part is d / 2**(span + 1) of a quantum: d = 2 * (sig mod 2**span), so that 1/2
    # is 2**span even for span = 0. Past man + 1 every bit of sig is discarded and the fraction is
    # below 1/2: clamping span to man + 2 keeps both facts and every shift count inside the word.
    span = shift.clamp(0, man + 2)
    half = 1 << span
    d = (sig << 1) & ((half << 1) - 1)
    kept_shift = shift.clamp(0, man + 1)
    if rule in (Rounding.nearest, Rounding.odd):
        kept_odd = (sig >> kept_shift) & 1  # the last kept bit (0 when nothing is kept)
        if k.code_parity and k.keep == 0:
            # Precision 1 with the code's parity (round.h): the kept value is 0 or the power of two
            # 2**exponent, whose exponent code is exponent - qmin + 1. exponent is exact here:
            # without the leading one's position (qmin >= 1) every container subnormal lies below
            # the grid and keeps nothing. (At precision > 1 a lone leading one is odd either way.)
            kept_odd = kept_odd & (((exponent - k.qmin) & 1) ^ 1)

    if rule == Rounding.nearest:
        up = d + kept_odd > half  # d and half are even unless span = 0, where d = 0 < half
    elif rule == Rounding.nearest_away:
        up = d >= half
    elif rule == Rounding.nearest_zero:
        up = d > half
    elif rule == Rounding.toward_zero:
        up = None
    elif rule == Rounding.away:
        up = d != 0
    elif rule == Rounding.up:
        up = (d != 0) & ~negative
    elif rule == Rounding.down:
        up = (d != 0) & negative
    else:  # odd
        up = (d != 0) & (kept_odd == 0)

    # On the grid: the kept bits plus the increment, carrying into the exponent field when the
    # significand overflows. Below the finest quantum (shift > man) the value lies strictly
    # between 0 and min_positive.
    tiny = shift > man
    if up is None:
        mag = torch.where(tiny, 0, (a >> kept_shift) << kept_shift)
    else:
        step = up.to(a.dtype)
        kept = ((a >> kept_shift) + step) << kept_shift
        mag = torch.where(tiny, (-step) & k.min_positive, kept)  # up ? min_positive : 0

    # Overflow: rules that round toward zero keep the largest finite value, as in IEEE 754.
    limit = _pick(negative, k.neg_limit, k.pos_limit, a)
    if not (k.pos_limit == k.neg_limit == k.inf_bits):  # else nothing finite exceeds the limit
        unclamped = _pick(negative, k.neg_overflow, k.pos_overflow, a)
        if rule in (Rounding.toward_zero, Rounding.odd):
            overflow = limit
        elif rule == Rounding.up:
            overflow = _either(negative, limit, unclamped, a)
        elif rule == Rounding.down:
            overflow = _either(negative, unclamped, limit, a)
        else:
            overflow = unclamped
        mag = torch.where(mag > limit, overflow, mag)

    # Inf becomes the grid's Inf (or its limit, or NaN); a zero drops its sign where the grid has
    # no -0; NaN is returned unchanged.
    mag = torch.where(magnitude >= k.inf_bits, _pick(negative, k.neg_inf, k.pos_inf, a), mag)
    signed = negative if k.keeps_negative_zero else negative & (mag != 0)
    out = torch.where(signed, mag | k.sign_bit, mag)
    out = torch.where(magnitude > k.inf_bits, u, out)
    if layout.work != layout.storage:
        out = out.to(layout.storage)
    return out.view(x.dtype)


def _either(condition: torch.Tensor, a, b, like: torch.Tensor) -> torch.Tensor | int:
    """condition ? a : b for tensors or Python ints, in like's type where a tensor is made."""
    if isinstance(a, int) and isinstance(b, int):
        return _pick(condition, a, b, like)
    return torch.where(condition, a, b)


def _quantize_format(x: torch.Tensor, fmt, rule: Rounding) -> torch.Tensor:
    """quantize_grid_torch(x, fmt.grid(), rule), arguments checked (_fusable_format)."""
    return _quantize_bits(x, format_constants(fmt, x.dtype), rule)


class _StraightThrough(torch.autograd.Function):
    """_quantize_format with the identity gradient (what the custom op's autograd formula in
    lpsim._ops gives)."""

    @staticmethod
    def forward(ctx, x, fmt, rule):
        return _quantize_format(x, fmt, rule)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _fusable_format(x, fmt, rounding, rbits, seed, offset) -> tuple[object, Rounding] | None:
    """(fmt, rule) when the fusable form applies to these quantize() arguments, else None. Checks
    the arguments as quantize() does, so both paths raise the same errors."""
    rule = Rounding.parse(rounding)
    if not isinstance(fmt, GRID_FORMATS) or rule.is_stochastic:
        return None
    if under_torch_func():
        # torch.func's transforms (vmap of grad) traced by dynamo: dynamo's form of the
        # straight-through Function has no vmap rule and failed there; the custom op has one.
        return None
    check_container(x)
    fmt.grid_arguments(x.dtype)  # raises ValueError when the format does not fit x's dtype
    # rbits (refused for a deterministic rule), seed (checked, then unused) and offset, as the
    # custom op's caller checks them
    random_args(rule, rbits, seed, offset)
    return fmt, rule


def compiled_quantize(
    x: torch.Tensor,
    fmt,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """lpsim.quantize(x, fmt, rounding, ...) in fusable torch ops, or None where there is none.

    For a Float, Fixed or P3109 ``fmt`` and a deterministic rule (FUSABLE_RULES), without
    ``out``: a new tensor of x's dtype, shape and layout holding x rounded into fmt, bit for bit
    the custom op's result, with the straight-through gradient (the gradient passes unchanged).
    Otherwise None: the caller uses the custom op. ``seed`` is checked, then ignored, as the custom
    op's caller treats it for these rules.

    Raises:
        TypeError, ValueError: as lpsim.quantize for the same arguments.
    """
    if out is not None:
        return None
    found = _fusable_format(x, fmt, rounding, rbits, seed, offset)
    if found is None:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, *found)
    return _quantize_format(x, *found)  # no graph to record (a backward pass, say)


def compiled_quantize_(
    x: torch.Tensor,
    fmt,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor | None:
    """lpsim.quantize_(x, fmt, rounding, ...) in fusable torch ops: x rounded in place and
    returned, or None (x untouched) where compiled_quantize returns None.

    The write is ``x.copy_``, so autograd treats it as torch's in-place ops: the version counter
    is bumped, a leaf that requires grad is refused outside torch.no_grad(), and through a
    non-leaf the gradient stays the identity.

    Raises:
        TypeError, ValueError: as lpsim.quantize_ for the same arguments.
    """
    found = _fusable_format(x, fmt, rounding, rbits, seed, offset)
    if found is None:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return x.copy_(_StraightThrough.apply(x, *found))
    return x.copy_(_quantize_format(x, *found))

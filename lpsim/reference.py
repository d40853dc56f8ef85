"""An exact, slow oracle for lpsim's quantisation, for tests and debugging.

Everything here is defined on values, not bits: an element is rounded with rational arithmetic
(fractions.Fraction) onto the format's grid, the set of multiples of the spacing 2**max(E - man,
emin - man) in the binade [2**E, 2**(E+1)) (a constant 2**-fl for Fixed, a per-block spacing for
BlockFloat), continued past the largest finite value so that overflow can be decided. The random
words come from a Philox4x32-10 written here from the published algorithm. None of it shares code
with the compiled kernels, which compute the same function on the container's bits.

Use ``quantize(x, fmt, rounding, rbits=..., seed=..., offset=...)`` exactly like lpsim.quantize
(``seed`` is required for the stochastic rules). It takes about 20 microseconds per element.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from lpsim.formats import P3109, BlockFloat, Fixed, Float, container_of
from lpsim.mac import BINARY32_EMIN, MAC, WORDS_PER_TERM, TensorCore
from lpsim.rounding import MAX_RBITS, Rounding
from lpsim.scaled import PowerOfTwo, Scaled

__all__ = [
    "quantize",
    "round_value",
    "round_rational",
    "philox4x32_10",
    "random_word",
    "RefGrid",
    "grid_of",
    "round_sum",
    "container_grid",
    "value_word",
    "sr_add",
    "addc_term",
    "sum_rounded",
    "dot_rounded",
    "mac_matmul",
    "mac_dot",
    "tensor_core_step",
    "alignment_exponent",
    "scaled_block_keys",
    "scaled_block_scale",
]

_MASK32 = 0xFFFFFFFF

# Philox4x32-10 (Salmon et al., SC 2011): multipliers and Weyl key increments.
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85

# Element index -> (counter, word): groups of 256 elements use 64 counters, word-major.
GROUP_SIZE = 256
GROUP_COUNTERS = 64


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """The four 32-bit output words of Philox4x32 with 10 rounds."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = _PHILOX_M0 * c0
        p1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def random_word(seed: int, offset: int, index: int) -> int:
    """The 32-bit random word of element ``index`` (row-major position) under (seed, offset)."""
    group, rest = divmod(index, GROUP_SIZE)
    word, lane = divmod(rest, GROUP_COUNTERS)
    return _counter_words(group * GROUP_COUNTERS + lane, seed, offset)[word]


@functools.lru_cache(maxsize=1 << 16)
def _counter_words(counter: int, seed: int, offset: int) -> tuple[int, ...]:
    return philox4x32_10(
        (counter & _MASK32, counter >> 32, offset & _MASK32, offset >> 32),
        (seed & _MASK32, seed >> 32),
    )


def _floor_log2(m: Fraction) -> int:
    e = m.numerator.bit_length() - m.denominator.bit_length()
    return e if Fraction(2) ** e <= m else e - 1


@dataclass(frozen=True)
class RefGrid:
    """A grid in value terms. spacing(m) is the distance between grid points around magnitude m."""

    man: int | None  # significand bits after the leading one; None: no such limit (Fixed, block)
    qmin: int  # exponent of the finest spacing
    flush_below: int | None  # without subnormals: magnitudes below 2**flush_below use that spacing
    pos_limit: Fraction | None  # None: unbounded
    neg_limit: Fraction | None
    saturate: bool
    has_inf: bool  # +Inf, and -Inf where there are negative values (neg_limit != 0)
    unsigned_zero: bool
    code_parity: bool = False  # a tie at precision 1 goes to the even exponent code (P3109)

    @property
    def has_negative_inf(self) -> bool:
        return self.has_inf and self.neg_limit != 0

    def spacing(self, m: Fraction) -> Fraction:
        if self.flush_below is not None and m < Fraction(2) ** self.flush_below:
            return Fraction(2) ** self.flush_below
        e = self.qmin if self.man is None else max(_floor_log2(m) - self.man, self.qmin)
        return Fraction(2) ** e


def grid_of(fmt: Float | Fixed | P3109) -> RefGrid:
    """The grid of a Float, Fixed or P3109 format, from its definition."""
    if isinstance(fmt, Float):
        limit = Fraction(fmt.max)
        return RefGrid(
            man=fmt.man,
            qmin=fmt.emin - fmt.man,
            flush_below=None if fmt.subnormals else fmt.emin,
            pos_limit=limit,
            neg_limit=limit,
            saturate=fmt.saturate,
            has_inf=fmt.has_inf,
            unsigned_zero=not fmt.has_negative_zero,
        )
    if isinstance(fmt, P3109):
        # The saturation modes (P3109's docstring): SatFinite clamps everything, Inf included;
        # SatPropagate clamps finite results and keeps the Inf the format has; SatNone clamps
        # nothing (but for the rules that round toward zero) and keeps the Inf the format has.
        man = fmt.precision - 1
        return RefGrid(
            man=man,
            qmin=fmt.emin - man,
            flush_below=None,
            pos_limit=Fraction(fmt.max),
            neg_limit=Fraction(fmt.max) if fmt.signed else Fraction(0),
            saturate=fmt.saturation != "SatNone",
            has_inf=fmt.has_inf and fmt.saturation != "SatFinite",
            unsigned_zero=True,
            code_parity=True,
        )
    bounded = fmt.clamp
    return RefGrid(
        man=None,
        qmin=-fmt.fl,
        flush_below=None,
        pos_limit=Fraction(fmt.max) if bounded else None,
        neg_limit=-Fraction(fmt.min) if bounded else None,
        saturate=bounded,
        has_inf=not bounded,
        unsigned_zero=not fmt.signed,
    )


def block_grid(wl: int, max_abs: Fraction, dtype: torch.dtype) -> RefGrid:
    """The grid of one BlockFloat block whose largest finite magnitude is max_abs."""
    c = container_of(dtype)
    floor_exponent = c.qmin + wl - 2  # keeps the spacing representable in the container
    e = floor_exponent if max_abs == 0 else max(_floor_log2(max_abs), floor_exponent)
    q = e - (wl - 2)
    limit = (2 ** (wl - 1) - 1) * Fraction(2) ** q
    return RefGrid(
        man=None,
        qmin=q,
        flush_below=None,
        pos_limit=limit,
        neg_limit=limit,
        saturate=True,
        has_inf=True,
        unsigned_zero=False,
    )


def _rounds_up(
    rule: Rounding, negative: bool, odd: bool, frac: Fraction, word: int, rbits: int
) -> bool:
    """Whether the magnitude k*q + frac*q (0 <= frac < 1) goes to (k+1)*q rather than k*q; odd
    says whether k*q counts as odd (_odd_code)."""
    half = Fraction(1, 2)
    if rule is Rounding.nearest:
        return frac > half or (frac == half and odd)
    if rule is Rounding.nearest_away:
        return frac >= half
    if rule is Rounding.nearest_zero:
        return frac > half
    if rule is Rounding.toward_zero:
        return False
    if rule is Rounding.away:
        return frac > 0
    if rule is Rounding.up:
        return frac > 0 and not negative
    if rule is Rounding.down:
        return frac > 0 and negative
    if rule is Rounding.odd:
        return frac > 0 and not odd
    truncated = math.floor(frac * 2**rbits)  # frac truncated to rbits bits, as an integer
    if rule is Rounding.stochastic:
        return truncated + (word >> (MAX_RBITS - rbits)) >= 2**rbits
    if rule is Rounding.stochastic_equal:
        moves = frac > 0 if rbits == MAX_RBITS else truncated > 0
        return moves and word >= 2**31
    raise AssertionError(rule)


def _toward_zero_on_overflow(rule: Rounding, negative: bool) -> bool:
    return (
        rule in (Rounding.toward_zero, Rounding.odd)
        or (rule is Rounding.up and negative)
        or (rule is Rounding.down and not negative)
    )


def round_value(
    v: float, grid: RefGrid, rule: Rounding, word: int = 0, rbits: int = MAX_RBITS
) -> float:
    """v rounded onto the grid by the rule (word: the element's random word), as a float."""
    if math.isnan(v):
        return math.nan
    negative = math.copysign(1.0, v) < 0
    limit = grid.neg_limit if negative else grid.pos_limit
    if math.isinf(v):
        if grid.has_negative_inf if negative else grid.has_inf:
            return v
        return _signed(limit, negative, grid) if grid.saturate else math.nan
    return round_rational(abs(Fraction(v)), negative, grid, rule, word, rbits)


def round_rational(
    m: Fraction,
    negative: bool,
    grid: RefGrid,
    rule: Rounding,
    word: int = 0,
    rbits: int = MAX_RBITS,
) -> float:
    """The finite value (-1)**negative * m (m >= 0, any rational) rounded onto the grid, as a float
    (+/-inf where the rounded magnitude exceeds the float range)."""
    limit = grid.neg_limit if negative else grid.pos_limit
    if m == 0:
        return _signed(Fraction(0), negative, grid)
    q = grid.spacing(m)
    k = math.floor(m / q)
    frac = m / q - k
    mag = (k + _rounds_up(rule, negative, _odd_code(grid, k, q), frac, word, rbits)) * q
    if limit is not None and mag > limit:
        if grid.saturate or _toward_zero_on_overflow(rule, negative):
            mag = limit
        elif grid.has_negative_inf if negative else grid.has_inf:
            return -math.inf if negative else math.inf
        else:
            return math.nan
    return _signed(mag, negative, grid)


def _odd_code(grid: RefGrid, k: int, q: Fraction) -> bool:
    """Whether the grid value k*q counts as odd for ties to even and rounding to odd: k is odd,
    except at precision 1 (man = 0) in a grid with code_parity, where the value 1 * 2**e counts
    by its exponent code, e - qmin + 1."""
    if grid.code_parity and grid.man == 0 and k == 1:
        return (_floor_log2(q) - grid.qmin) % 2 == 0
    return k % 2 == 1


def _signed(mag: Fraction, negative: bool, grid: RefGrid) -> float:
    try:
        value = float(mag)
    except OverflowError:  # an unbounded grid past the float64 range
        value = math.inf
    if mag == 0 and grid.unsigned_zero:
        return 0.0
    return -value if negative else value


def _block_keys(shape: tuple[int, ...], fmt: BlockFloat) -> list:
    """The block each element (in row-major order) belongs to."""
    count = math.prod(shape)
    if fmt.block_size is not None:
        row_len = shape[-1] if shape else 1
        return [(i // row_len, (i % row_len) // fmt.block_size) for i in range(count)]
    if fmt.dim is None or not shape:
        return [0] * count
    d = fmt.dim % len(shape)
    inner = math.prod(shape[d + 1 :])
    return [(i // inner) % shape[d] for i in range(count)]


def quantize(
    x: torch.Tensor,
    fmt: Float | Fixed | BlockFloat | Scaled,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """What lpsim.quantize returns, computed exactly and slowly. ``seed`` is required for the
    stochastic rules."""
    rule = Rounding.parse(rounding)
    bits = MAX_RBITS if rbits is None else rbits
    if rule.is_stochastic and seed is None:
        raise ValueError("reference.quantize needs an explicit seed for stochastic rounding")
    values = x.detach().cpu().double().flatten().tolist()

    def word(i: int) -> int:
        return random_word(seed, offset, i) if rule.is_stochastic else 0

    if isinstance(fmt, Scaled):
        out = _quantize_scaled(values, tuple(x.shape), x.dtype, fmt, rule, word, bits)
    elif isinstance(fmt, BlockFloat):
        keys = _block_keys(tuple(x.shape), fmt)
        max_abs: dict = {}
        for key, v in zip(keys, values):
            if math.isfinite(v):
                max_abs[key] = max(max_abs.get(key, Fraction(0)), abs(Fraction(v)))
        grids = {
            key: block_grid(fmt.wl, max_abs.get(key, Fraction(0)), x.dtype) for key in set(keys)
        }
        out = [
            round_value(v, grids[key], rule, word(i), bits)
            for i, (key, v) in enumerate(zip(keys, values))
        ]
    else:
        grid = grid_of(fmt)
        out = [round_value(v, grid, rule, word(i), bits) for i, v in enumerate(values)]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.dtype)


# ---- Stochastic arithmetic: sums computed exactly and rounded once, and recursive sums rounded
# after every operation (lpsim.update, lpsim.accumulate). Defined on values: the exact sum is a
# Fraction, rounded by round_rational.

_VALUE_TAG0, _VALUE_TAG1 = 0x756C6176, 0x79656B65  # "valu", "ekey"


def _float64_bits(v: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", v))[0]


def value_word(seed: int, offset: int, a: float, b: float) -> int:
    """The value-keyed random word for operands a and b under (seed, offset): Philox4x32-10 on the
    counter of a's and b's float64 bits (low word first) under a key derived from (seed, offset)
    by one Philox call on (offset, "valu", "ekey")."""
    key = philox4x32_10(
        (offset & _MASK32, offset >> 32, _VALUE_TAG0, _VALUE_TAG1), (seed & _MASK32, seed >> 32)
    )[:2]
    ab, bb = _float64_bits(a), _float64_bits(b)
    return philox4x32_10((ab & _MASK32, ab >> 32, bb & _MASK32, bb >> 32), key)[0]


def round_sum(
    a: float, b: float, grid: RefGrid, rule: Rounding, word: int = 0, rbits: int = MAX_RBITS
) -> float:
    """The exact sum a + b rounded once onto the grid. IEEE 754 decides the special cases: a NaN
    operand or Inf - Inf gives NaN, an Inf operand gives that Inf (then rounded onto the grid), and
    an exact zero is +0 (-0 under "down") unless both operands are zeros of one sign."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        if math.isinf(a) and math.isinf(b) and (a > 0) != (b > 0):
            return math.nan
        return round_value(a if math.isinf(a) else b, grid, rule, word, rbits)
    total = Fraction(a) + Fraction(b)
    if total == 0:
        sign_a, sign_b = math.copysign(1.0, a) < 0, math.copysign(1.0, b) < 0
        negative = sign_a if sign_a == sign_b else rule is Rounding.down
        return _signed(Fraction(0), negative, grid)
    return round_rational(abs(total), total < 0, grid, rule, word, rbits)


def sr_add(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: Float | Fixed | None = None,
    rounding: Rounding | str = "stochastic",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    randomness: str = "position",
) -> torch.Tensor:
    """What lpsim.sr_add returns, computed exactly and slowly (b: a tensor broadcastable to a).
    ``seed`` is required for the stochastic rules."""
    rule = Rounding.parse(rounding)
    bits = MAX_RBITS if rbits is None else rbits
    if rule.is_stochastic and seed is None:
        raise ValueError("reference.sr_add needs an explicit seed for stochastic rounding")
    grid = container_grid(fmt if fmt is not None else _own_format(a.dtype), a.dtype)
    av = a.detach().cpu().double().flatten().tolist()
    bv = b.detach().cpu().double().expand(a.shape).flatten().tolist()
    out = []
    for i, (x, y) in enumerate(zip(av, bv)):
        word = 0
        if rule.is_stochastic:
            word = (
                random_word(seed, offset, i)
                if randomness == "position"
                else value_word(seed, offset, x, y)
            )
        out.append(round_sum(x, y, grid, rule, word, bits))
    return torch.tensor(out, dtype=torch.float64).reshape(a.shape).to(a.dtype)


def addc_term(
    a_dtype: torch.dtype, t1: torch.Tensor, t2: torch.Tensor, value: float, divide: bool
) -> torch.Tensor:
    """The term (value * t1) * t2 (or (value * t1) / t2) of sr_addcmul / sr_addcdiv, in torch's
    order: computed in float64 when a or the tensors are float64, else float32, each operation
    rounded to nearest, except addcmul's last product in float32, which is exact (returned in
    float64)."""
    wide = torch.float64 if torch.float64 in (a_dtype, t1.dtype, t2.dtype) else torch.float32
    v = torch.tensor(value, dtype=torch.float64).to(wide)
    p, q = t1.to(wide), t2.to(wide)
    if divide:
        return (v * p) / q
    return (v * p).double() * q.double()  # exact for float32 factors, rounded for float64 ones


def container_grid(fmt: Float | Fixed, dtype: torch.dtype) -> RefGrid:
    """The grid of fmt's values that a dtype holds, which a rational sum is rounded onto. It is
    grid_of(fmt) except for unclamped Fixed formats, whose grid continues past their range: there
    only the container's values remain (its precision), up to the largest of them, the container's
    largest multiple of the format's spacing, past which IEEE 754's overflow rules apply."""
    grid = grid_of(fmt)
    if isinstance(fmt, Fixed) and not fmt.clamp:
        own = _own_format(dtype)
        spacing = Fraction(2) ** -fmt.fl
        top = Fraction(own.max) // spacing * spacing
        grid = dataclasses.replace(grid, man=own.man, pos_limit=top, neg_limit=top)
    return grid


def _own_format(dtype: torch.dtype) -> Float:
    c = container_of(dtype)
    return Float(c.exp, c.man)


def _accumulate(terms, acc: RefGrid, rule: Rounding, bits: int, word) -> list[float]:
    """The partial sums of one reduction: the first term rounded, then each sum rounded.
    word(k) is the random word of rounding k."""
    partial, s = [], None
    for k, t in enumerate(terms):
        w = word(k) if rule.is_stochastic else 0
        s = round_value(t, acc, rule, w, bits) if s is None else round_sum(s, t, acc, rule, w, bits)
        partial.append(s)
    return partial


def sum_rounded(
    x: torch.Tensor,
    dim: int | None,
    acc: Float | Fixed,
    rounding: Rounding | str,
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    cumulative: bool = False,
) -> torch.Tensor:
    """What lpsim.accumulate.sum (cumulative: cumsum) computes, as float64: along dim (all
    elements in row-major order for None), recursive summation in increasing index order, each
    partial sum rounded onto acc; rounding k of reduction r takes word 2 (r n + k)."""
    rule = Rounding.parse(rounding)
    bits = MAX_RBITS if rbits is None else rbits
    grid = container_grid(acc, torch.float64)
    v = x.detach().cpu().double()
    if dim is None:
        v = v.reshape(1, -1, 1)
    else:
        d = dim % max(x.dim(), 1)
        v = v.reshape(math.prod(x.shape[:d]), x.shape[d], math.prod(x.shape[d + 1 :]))
    outer, n, inner = v.shape
    out = torch.zeros(outer, n if cumulative else 1, inner, dtype=torch.float64)
    for o in range(outer):
        for j in range(inner):
            r = o * inner + j
            partial = _accumulate(
                v[o, :, j].tolist(),
                grid,
                rule,
                bits,
                lambda k, r=r: random_word(seed, offset, 2 * (r * n + k)),
            )
            if cumulative:
                out[o, :, j] = torch.tensor(partial, dtype=torch.float64)
            elif partial:
                out[o, 0, j] = partial[-1]
    return out


def dot_rounded(
    a: torch.Tensor,
    b: torch.Tensor,
    acc: Float | Fixed,
    mul: Float | Fixed | None,
    rounding: Rounding | str,
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """What lpsim.accumulate.matmul computes for a (m, n) and b (n, p), as float64: c[i, l] sums the
    exact products a[i, k] b[k, l], each rounded onto mul when given (word 2 (r n + k) + 1), in
    increasing k, each partial sum rounded onto acc (word 2 (r n + k)), r = i p + l."""
    rule = Rounding.parse(rounding)
    bits = MAX_RBITS if rbits is None else rbits
    acc_grid = container_grid(acc, torch.float64)
    mul_grid = container_grid(mul, torch.float64) if mul is not None else None
    av, bv = a.detach().cpu().double().tolist(), b.detach().cpu().double().tolist()
    m, n, p = len(av), a.shape[1], b.shape[1]
    out = torch.zeros(m, p, dtype=torch.float64)
    for i in range(m):
        for j in range(p):
            r = i * p + j
            products = []
            for k in range(n):
                prod = av[i][k] * bv[k][j]  # exact: float64 holds products of 24-bit significands
                if mul_grid is not None:
                    w = random_word(seed, offset, 2 * (r * n + k) + 1) if rule.is_stochastic else 0
                    prod = round_value(prod, mul_grid, rule, w, bits)
                products.append(prod)
            partial = _accumulate(
                products,
                acc_grid,
                rule,
                bits,
                lambda k, r=r: random_word(seed, offset, 2 * (r * n + k)),
            )
            out[i, j] = partial[-1] if partial else 0.0
    return out


# ---- Simulated multiply-accumulate (lpsim.mac): every MAC variant on exact rationals.


def alignment_exponent(x: float, emin: int) -> int:
    """The exponent a tensor core aligns the finite nonzero x by: floor(log2 |x|), at least emin."""
    return max(_floor_log2(abs(Fraction(x))), emin)


def tensor_core_step(
    products: list[float],
    exponents: list[int],
    c: float,
    core: TensorCore,
    grid: RefGrid,
    word: int = 0,
    rbits: int = MAX_RBITS,
) -> float:
    """One step of a tensor core (lpsim.mac.TensorCore defines it): the exact products of a group
    (float64 values), product k aligned by exponents[k], and the running value c, summed on
    rationals after truncation toward zero to multiples of 2^(E - F), then rounded onto grid by
    core.normalise (word: its random word)."""
    values = list(products) + [c]
    if any(math.isnan(v) for v in values):
        return math.nan
    infinities = {v for v in values if math.isinf(v)}
    if len(infinities) == 2:
        return math.nan
    if infinities:
        return round_value(infinities.pop(), grid, core.normalise, word, rbits)
    terms = [(Fraction(p), e) for p, e in zip(products, exponents) if p != 0]
    if c != 0:
        terms.append((Fraction(c), alignment_exponent(c, BINARY32_EMIN)))
    if not terms:
        return 0.0
    top = max(e for _, e in terms)
    if core.exponent_floor is not None:
        top = max(top, core.exponent_floor)
    unit = Fraction(2) ** (top - core.fraction_bits)
    total = sum((math.trunc(v / unit) for v, _ in terms), 0) * unit
    if total == 0:
        return 0.0
    return round_rational(abs(total), total < 0, grid, core.normalise, word, rbits)


def mac_dot(
    products: list[float],
    mac: MAC,
    word=lambda k, j: 0,
    rbits: int = MAX_RBITS,
    exponents: list[int] | None = None,
) -> float:
    """The sum of one result's exact products (float64 values) as ``mac`` adds them (lpsim.mac's
    docstring defines every variant), each rounding exact and then rounded once.
    ``word(k, j)`` is the random word of rounding j of term k. A tensor core needs ``exponents``:
    exponents[k] aligns product k (the sum of its operands' alignment_exponent)."""
    if mac.native:
        raise ValueError("the native MAC (accumulator=None) adds in an unspecified order")
    rule = mac.rounding
    acc = container_grid(mac.accumulator, torch.float64)
    if mac.tensor_core is not None:
        return _tensor_core_dot(products, exponents, mac, acc, word, rbits)

    def rounded(v: float, grid: RefGrid, k: int, j: int) -> float:
        return round_value(v, grid, rule, word(k, j), rbits)

    def added(a: float, b: float, grid: RefGrid, k: int, j: int) -> float:
        return round_sum(a, b, grid, rule, word(k, j), rbits)

    terms = products
    if mac.product is not None:
        mul = container_grid(mac.product, torch.float64)
        terms = [rounded(t, mul, k, 0) for k, t in enumerate(products)]
    if not terms:
        return 0.0

    def sequential(first: int, last: int, grid: RefGrid) -> float:
        s = rounded(terms[first], grid, first, 1)
        for k in range(first + 1, last):
            s = added(s, terms[k], grid, k, 1)
        return s

    if mac.order == "sequential" and mac.compensated:
        s, c = rounded(terms[0], acc, 0, 1), 0.0
        for k in range(1, len(terms)):
            y = added(terms[k], -c, acc, k, 3)
            u = added(s, y, acc, k, 1)
            c = added(added(u, -s, acc, k, 4), -y, acc, k, 5)
            s = u
        return s
    if mac.order == "sequential":
        return sequential(0, len(terms), acc)
    if mac.order == "chunked":
        inner = container_grid(mac.chunk_accumulator or mac.accumulator, torch.float64)
        s = None
        for first in range(0, len(terms), mac.chunk):
            last = min(first + mac.chunk, len(terms))
            u = sequential(first, last, inner)
            s = rounded(u, acc, last - 1, 2) if s is None else added(s, u, acc, last - 1, 2)
        return s

    def tree(lo: int, hi: int) -> float:
        if hi - lo == 1:
            return terms[lo]
        split = lo + (1 << ((hi - lo - 1).bit_length() - 1))
        return added(tree(lo, split), tree(split, hi), acc, split, 1)

    return rounded(terms[0], acc, 0, 1) if len(terms) == 1 else tree(0, len(terms))


def _tensor_core_dot(products, exponents, mac: MAC, acc: RefGrid, word, rbits: int) -> float:
    """mac_dot with a tensor core: groups chained from c = +0 in the accumulator (sequential), or
    in the chunk accumulator per chunk, each chunk's result added into the accumulator."""
    core = mac.tensor_core
    rule = mac.rounding

    def chain(first: int, last: int, grid: RefGrid) -> float:
        c = 0.0
        for start in range(first, last, core.group):
            end = min(start + core.group, last)
            w = word(end - 1, 1) if core.normalise.is_stochastic else 0
            c = tensor_core_step(products[start:end], exponents[start:end], c, core, grid, w, rbits)
        return c

    if not products:
        return 0.0
    if mac.order == "sequential":
        return chain(0, len(products), acc)
    inner = container_grid(mac.chunk_accumulator or mac.accumulator, torch.float64)
    s = None
    for first in range(0, len(products), mac.chunk):
        last = min(first + mac.chunk, len(products))
        u = chain(first, last, inner)
        w = word(last - 1, 2) if rule.is_stochastic else 0
        s = (
            round_value(u, acc, rule, w, rbits)
            if s is None
            else round_sum(s, u, acc, rule, w, rbits)
        )
    return s


def mac_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    mac: MAC,
    *,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """What a matrix product a (M, K) @ b (K, N) gives under ``mac``, as float64: result r = i N + j
    is mac_dot of the exact products a[i, k] b[k, j], rounding j of its term k drawing word
    8 (r K + k) + j of (seed, offset). a and b hold float32, bfloat16 or float16 values (whose
    products float64 holds exactly); ``seed`` is required for a stochastic rule."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"mac_matmul takes a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if mac.drawing_rule.is_stochastic and seed is None:
        raise ValueError("a stochastic MAC needs a seed")
    core = mac.tensor_core
    emin = core.operand_emin(a.dtype) if core is not None else 0
    bits = MAX_RBITS if mac.rbits is None else mac.rbits
    av, bv = a.detach().cpu().double().tolist(), b.detach().cpu().double().tolist()
    m, n_terms, n = a.shape[0], a.shape[1], b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            r = i * n + j

            def word(k: int, slot: int, r=r) -> int:
                if not mac.drawing_rule.is_stochastic:
                    return 0
                return random_word(seed, offset, WORDS_PER_TERM * (r * n_terms + k) + slot)

            products = [av[i][k] * bv[k][j] for k in range(n_terms)]  # exact in float64
            exponents = None
            if core is not None:
                exponents = [
                    alignment_exponent(av[i][k], emin) + alignment_exponent(bv[k][j], emin)
                    if math.isfinite(av[i][k] * bv[k][j]) and av[i][k] * bv[k][j] != 0
                    else 0
                    for k in range(n_terms)
                ]
            out[i, j] = mac_dot(products, mac, word, bits, exponents)
    return out


# ---- Scaled formats (lpsim.scaled): each block's scale from its largest magnitude, then its
# elements rounded. Power-of-two scales exactly, with Fractions; Float scales in the arithmetic
# the format defines (float32, or float64 for float64 tensors), with numpy's IEEE scalars.


def scaled_block_keys(shape: tuple[int, ...], fmt: Scaled) -> list:
    """The block each element (in row-major order) belongs to: elements with equal keys share a
    scale."""
    dims = list(shape) or [1]
    count = math.prod(dims)
    block = fmt.block
    if block == "tensor":
        return [0] * count
    if isinstance(block, tuple):
        if len(dims) == 1:
            dims = [1, *dims]
        rows, cols = dims[-2], dims[-1]
        keys = []
        for i in range(count):
            r, c = (i // cols) % rows, i % cols
            keys.append((i // (rows * cols), r // block[0], c // block[1]))
        return keys
    d = fmt.axis % len(dims)
    length, inner = dims[d], math.prod(dims[d + 1 :])
    size = length if block is None else block
    return [(i // (length * inner), (i // inner) % length // size, i % inner) for i in range(count)]


def _ceil_log2(m: Fraction) -> int:
    e = _floor_log2(m)
    return e if Fraction(2) ** e == m else e + 1


def _arithmetic(dtype: torch.dtype):
    """The numpy scalar type a scaled format's float arithmetic uses for tensors of dtype."""
    return np.float64 if dtype == torch.float64 else np.float32


def _tensor_scale(values: list[float], fmt: Scaled, real) -> float:
    """NVFP4's per-tensor scale t (NaN when the tensor holds a NaN or Inf)."""
    if any(not math.isfinite(v) for v in values):
        return math.nan
    amax = max((abs(v) for v in values), default=0.0)
    with np.errstate(all="ignore"):
        t = real(real(amax) / real(fmt.scale.max * fmt.element.max))
    return float(max(t, real(2.0**-126 / fmt.scale.smallest_normal)))


def scaled_block_scale(block: list[float], fmt: Scaled, dtype: torch.dtype, t: float = 1.0):
    """The scale of one block of values, as ("power", e) for a PowerOfTwo scale 2**e, or
    ("float", r, c): the encoder multiplies by r, elements decode times c. None for a block that
    holds a NaN or an Inf."""
    if any(not math.isfinite(v) for v in block) or math.isnan(t):
        return None
    amax = max((abs(Fraction(v)) for v in block), default=Fraction(0))
    real = _arithmetic(dtype)
    elem_max = fmt.element.max
    if isinstance(fmt.scale, PowerOfTwo):
        emax = fmt.element_emax
        rule = fmt.scale_rule
        if rule == "rceil":
            with np.errstate(all="ignore"):
                d = float(real(real(float(amax)) / real(elem_max)))
            # A quotient beyond the arithmetic's range (elem_max < 1) takes the largest scale.
            e = None if d == 0 else fmt.scale.emax if math.isinf(d) else _ceil_log2(Fraction(d))
        elif amax == 0:
            e = None
        elif rule == "floor":
            e = _floor_log2(amax) - emax
        elif rule == "ceil":
            e = _ceil_log2(amax) - emax
        else:  # "even": amax rounded to the element's precision, ties away from zero
            q = Fraction(2) ** (_floor_log2(amax) - fmt.element_precision)
            e = _floor_log2(math.floor(amax / q + Fraction(1, 2)) * q) - emax
        e = fmt.scale.emin if e is None else min(max(e, fmt.scale.emin), fmt.scale.emax)
        return ("power", e)
    with np.errstate(all="ignore"):
        d = real(real(float(amax)) / real(elem_max))
        if fmt.tensor_scale:
            d = real(d / real(t))
        d = min(max(d, real(fmt.scale.smallest_normal)), real(fmt.scale.max))
        s = real(round_value(float(d), grid_of(fmt.scale), Rounding.nearest))
        if fmt.tensor_scale:
            return ("float", real(real(real(1) / real(t)) / s), real(real(t) * s))
        return ("float", real(real(1) / s), s)


def _quantize_scaled(values, shape, dtype, fmt: Scaled, rule, word, bits) -> list[float]:
    keys = scaled_block_keys(shape, fmt)
    blocks: dict = {}
    for key, v in zip(keys, values):
        blocks.setdefault(key, []).append(v)
    t = _tensor_scale(values, fmt, _arithmetic(dtype)) if fmt.tensor_scale else 1.0
    scales = {key: scaled_block_scale(block, fmt, dtype, t) for key, block in blocks.items()}
    grid = grid_of(fmt.saturating_element())
    real = _arithmetic(dtype)
    out = []
    for i, (key, v) in enumerate(zip(keys, values)):
        scale = scales[key]
        if scale is None:
            out.append(math.nan)
        elif scale[0] == "power":
            e = scale[1]
            m = abs(Fraction(v)) / Fraction(2) ** e
            q = round_rational(m, math.copysign(1.0, v) < 0, grid, rule, word(i), bits)
            out.append(math.ldexp(q, e))  # exact: q has few bits, and keeps its sign at 0
        else:
            _, r, c = scale
            with np.errstate(all="ignore"):
                y = float(real(real(v) * r))
                q = round_value(y, grid, rule, word(i), bits)
                decoded = float(real(real(q) * c))
                # A value of the format (the decoded element nearest y) comes back unchanged.
                nearest = float(real(real(round_value(y, grid, Rounding.nearest)) * c))
                nearest = float(torch.tensor(nearest, dtype=torch.float64).to(dtype))
                if nearest == v and math.copysign(1.0, nearest) == math.copysign(1.0, v):
                    decoded = v
                out.append(decoded)
    return out

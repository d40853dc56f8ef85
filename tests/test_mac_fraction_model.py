"""lpsim.mac.matmul against a second exact model written from the documentation alone (the module
docstring of lpsim.mac, docs/rounding.md and docs/formats.md): Fractions for every value, a
round-to-format of its own, IEEE 754 signed zeros and special values, and its own Philox4x32-10
(checked against Random123's known-answer vectors) for the stochastic rules' words. It shares no
code with lpsim.reference, so a misreading of the documentation that the reference and the kernel
share shows up here."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lpsim
from lpsim import MAC, Fixed, Float, Rounding

MASK = 0xFFFFFFFF


def philox4x32_10(counter, key):
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for i in range(10):
        if i:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def word(seed: int, offset: int, index: int) -> int:
    """docs/rounding.md: element 256 g + 64 w + l takes word w of counter 64 g + l, whose 128 bits
    are (counter, offset), keyed by the seed."""
    group, rest = divmod(index, 256)
    w, lane = divmod(rest, 64)
    counter = 64 * group + lane
    return philox4x32_10(
        (counter & MASK, counter >> 32, offset & MASK, offset >> 32), (seed & MASK, seed >> 32)
    )[w]


def test_philox_is_random123s():
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((MASK,) * 4, (MASK, MASK)) == (
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    )


class Grid:
    """A Float or Fixed format's values, as docs/formats.md defines them."""

    def __init__(self, fmt):
        if isinstance(fmt, Float):
            fnuz = fmt.special == "fnuz"
            default_bias = 2 ** (fmt.exp - 1) - (0 if fnuz else 1)
            bias = default_bias if fmt.bias is None else fmt.bias
            top = 2**fmt.exp - 1 - bias  # the exponent of the top exponent code
            if fmt.special == "ieee":
                largest = Fraction(2) ** (top - 1) * (2 - Fraction(1, 2**fmt.man))
            elif fmt.special == "fn":
                largest = Fraction(2) ** top * (2 - Fraction(2, 2**fmt.man))
            else:
                largest = Fraction(2) ** top * (2 - Fraction(1, 2**fmt.man))
            self.float, self.man, self.emin = True, fmt.man, 1 - bias
            self.subnormals, self.saturate = fmt.subnormals, fmt.saturate
            self.pos = self.neg = largest
            self.has_inf, self.no_negative_zero = fmt.special == "ieee", fnuz
        else:
            self.float, self.quantum = False, Fraction(2) ** -fmt.fl
            if fmt.signed:
                self.pos = (2 ** (fmt.wl - 1) - 1) * self.quantum
                self.neg = self.pos if fmt.symmetric else 2 ** (fmt.wl - 1) * self.quantum
            else:
                self.pos, self.neg = (2**fmt.wl - 1) * self.quantum, Fraction(0)
            self.saturate, self.has_inf = fmt.clamp, not fmt.clamp
            self.no_negative_zero = not fmt.signed

    def spacing(self, m: Fraction) -> Fraction:
        if not self.float:
            return self.quantum
        e = m.numerator.bit_length() - m.denominator.bit_length()
        e = e if Fraction(2) ** e <= m else e - 1
        if e < self.emin:
            return Fraction(2) ** (self.emin - (self.man if self.subnormals else 0))
        return Fraction(2) ** (e - self.man)

    def odd(self, k: int) -> bool:
        # man = 0: every significand is 1 (a tie goes to the larger magnitude); zero is even
        return k != 0 if self.float and self.man == 0 else k % 2 == 1

    def zero(self, negative: bool) -> float:
        return -0.0 if negative and not self.no_negative_zero else 0.0


TOWARD_ZERO = (Rounding.toward_zero, Rounding.odd)


def rounds_up(rule, negative, odd, frac, w, rbits) -> bool:
    half = Fraction(1, 2)
    decisions = {
        Rounding.nearest: frac > half or (frac == half and odd),
        Rounding.nearest_away: frac >= half,
        Rounding.nearest_zero: frac > half,
        Rounding.toward_zero: False,
        Rounding.away: frac > 0,
        Rounding.up: frac > 0 and not negative,
        Rounding.down: frac > 0 and negative,
        Rounding.odd: frac > 0 and not odd,
    }
    if rule in decisions:
        return decisions[rule]
    truncated = math.floor(frac * 2**rbits)
    if rule is Rounding.stochastic:
        return truncated + (w >> (32 - rbits)) >= 2**rbits
    moves = frac > 0 if rbits == 32 else truncated > 0
    return moves and w >= 2**31


def round_exact(v: Fraction, negative: bool, g: Grid, rule, w, rbits) -> float:
    """A rational rounded onto g (docs/rounding.md: exponent unbounded, then overflow)."""
    m = abs(v)
    if m == 0:
        return g.zero(negative)
    if negative and g.neg == 0:  # unsigned fixed point
        return 0.0
    q = g.spacing(m)
    k = math.floor(m / q)
    frac = m / q - k
    r = (k + (frac > 0 and rounds_up(rule, negative, g.odd(k), frac, w, rbits))) * q
    limit = g.neg if negative else g.pos
    if r > limit:
        toward_zero = rule in TOWARD_ZERO or rule is (Rounding.up if negative else Rounding.down)
        if g.saturate or (g.float and toward_zero):
            r = limit
        elif g.float:
            return math.copysign(math.inf if g.has_inf else math.nan, -1.0 if negative else 1.0)
    return g.zero(negative) if r == 0 else (-float(r) if negative else float(r))


def round_float(x: float, g: Grid, rule, w, rbits) -> float:
    if math.isnan(x):
        return math.nan
    if math.isinf(x):
        if g.has_inf:
            return x
        if g.saturate:  # an unsigned format's limit below is 0, which has no sign
            return (-float(g.neg) if g.neg else 0.0) if x < 0 else float(g.pos)
        return math.nan
    return round_exact(Fraction(x), math.copysign(1.0, x) < 0, g, rule, w, rbits)


def round_sum(a: float, b: float, g: Grid, rule, w, rbits) -> float:
    """round(a + b): IEEE 754's special values and zeros, then the exact sum rounded once."""
    if math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b) and a != b):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        return round_float(a if math.isinf(a) else b, g, rule, w, rbits)
    total = Fraction(a) + Fraction(b)
    if total == 0:
        same_zeros = a == 0 and b == 0 and math.copysign(1.0, a) == math.copysign(1.0, b)
        negative = math.copysign(1.0, a) < 0 if same_zeros else rule is Rounding.down
        return g.zero(negative)
    return round_exact(total, total < 0, g, rule, w, rbits)


def model_dot(a: list[float], b: list[float], mac: MAC, word_of) -> float:
    """One result as lpsim.mac's docstring defines the sum (word_of(k, j): rounding j of term k).
    Exact products of float32, bfloat16 and float16 values are float64 values."""
    rule, rbits = mac.rounding, mac.rbits or 32
    acc = Grid(mac.accumulator)
    terms = [x * y for x, y in zip(a, b)]
    if mac.product is not None:
        g = Grid(mac.product)
        terms = [round_float(t, g, rule, word_of(k, 0), rbits) for k, t in enumerate(terms)]
    if not terms:
        return 0.0

    def rounded(v, g, k, j):
        return round_float(v, g, rule, word_of(k, j), rbits)

    def added(u, v, g, k, j):
        return round_sum(u, v, g, rule, word_of(k, j), rbits)

    def sequential(first, last, g):
        s = rounded(terms[first], g, first, 1)
        for k in range(first + 1, last):
            s = added(s, terms[k], g, k, 1)
        return s

    if mac.compensated:
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
        inner = Grid(mac.chunk_accumulator or mac.accumulator)
        s = None
        for first in range(0, len(terms), mac.chunk):
            last = min(first + mac.chunk, len(terms))
            u = sequential(first, last, inner)
            s = rounded(u, acc, last - 1, 2) if s is None else added(s, u, acc, last - 1, 2)
        return s

    def tree(lo, hi):  # the left part: the largest power of two below the count
        if hi - lo == 1:
            return terms[lo]
        split = lo + 2 ** ((hi - lo - 1).bit_length() - 1)
        return added(tree(lo, split), tree(split, hi), acc, split, 1)

    return rounded(terms[0], acc, 0, 1) if len(terms) == 1 else tree(0, len(terms))


def model_matmul(a, b, mac: MAC, seed: int, offset: int) -> list[list[float]]:
    av, bv = a.double().tolist(), b.double().tolist()
    n_terms, n = a.shape[1], b.shape[1]
    out = []
    for i, row in enumerate(av):
        results = []
        for j in range(n):
            r = i * n + j

            def word_of(k, slot, r=r):
                return word(seed, offset, 8 * (r * n_terms + k) + slot)

            results.append(model_dot(row, [bv[k][j] for k in range(n_terms)], mac, word_of))
        out.append(results)
    return out


def assert_same_values(got: torch.Tensor, want: list[list[float]], context: str) -> None:
    for i, row in enumerate(want):
        for j, w in enumerate(row):
            g = got[i, j].item()
            same = (math.isnan(g) and math.isnan(w)) or (
                g == w and math.copysign(1.0, g) == math.copysign(1.0, w)
            )
            assert same, f"{context}: result ({i}, {j}) is {g!r}, the model gives {w!r}"


FORMATS = [
    Float(5, 10),
    Float(8, 7),
    Float(3, 2),
    Float(2, 1),
    Float(3, 0),
    Float(4, 3, special="fn"),
    Float(4, 3, special="fnuz"),
    Float(3, 2, special="none"),
    Float(5, 2, saturate=True),
    Float(4, 3, subnormals=False),
    Float(4, 2, bias=3),
    Fixed(8, 4),
    Fixed(6, 2, symmetric=True),
    Fixed(6, 3, signed=False),
]
RULES = [rule.name for rule in Rounding]
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e4, -1e4, 2.0**-20]


@st.composite
def macs(draw):
    accumulator = draw(st.sampled_from(FORMATS))
    rule = draw(st.sampled_from(RULES))
    fields = {}
    orders = ["sequential", "chunked", "pairwise"]
    if getattr(accumulator, "signed", True):  # Kahan's compensation needs a signed accumulator
        orders.append("kahan")
    order = draw(st.sampled_from(orders))
    if order == "kahan":
        fields["compensated"] = True
    elif order == "chunked":
        fields.update(order="chunked", chunk=draw(st.integers(1, 4)))
        fields["chunk_accumulator"] = draw(st.sampled_from([None, *FORMATS]))
    else:
        fields["order"] = order
    fields["product"] = draw(st.sampled_from([None, None, *FORMATS]))
    if Rounding.parse(rule).is_stochastic and draw(st.booleans()):
        fields["rbits"] = draw(st.integers(1, 32))
    return MAC(accumulator=accumulator, rounding=rule, **fields)


@settings(max_examples=150, deadline=None)
@given(
    mac=macs(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    shape=st.tuples(st.integers(1, 3), st.integers(0, 7), st.integers(1, 3)),
    scale=st.sampled_from([1.0, 0.01, 8.0, 300.0]),
    special=st.one_of(st.none(), st.sampled_from(SPECIALS)),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    data_seed=st.integers(0, 2**31),
)
def test_every_order_and_rule_gives_the_documented_sum_bit_for_bit(
    mac, dtype, shape, scale, special, seed, offset, data_seed
):
    m, k, n = shape
    g = torch.Generator().manual_seed(data_seed)
    a = torch.randn(m, k, generator=g) * scale
    b = torch.randn(k, n, generator=g)
    if special is not None and k:
        a[0, k // 2] = special
    a, b = a.to(dtype), b.to(dtype)
    got = lpsim.mac.matmul(a, b, mac, seed=seed, offset=offset)
    assert_same_values(got, model_matmul(a, b, mac, seed, offset), f"{mac} {dtype}")


def test_two_term_sums_of_every_pair_of_small_format_values_are_the_models():
    # Every pair of Float(2, 1) values (both signs, zeros, Inf, NaN) as two products of ones,
    # summed in narrow accumulators by every deterministic rule, sequentially, as a tree and by
    # Kahan's summation: ties, -0 results, overflow and its rules.
    values = sorted({*Float(2, 1).values().tolist(), *(-v for v in Float(2, 1).values().tolist())})
    values += [math.inf, -math.inf, math.nan, -0.0]
    a = torch.tensor([[x, y] for x in values for y in values])
    b = torch.ones(2, 1)
    deterministic = [rule for rule in RULES if not Rounding.parse(rule).is_stochastic]
    for accumulator in (Float(2, 1), Float(2, 0), Fixed(3, 1), Float(2, 1, saturate=True)):
        for rule in deterministic:
            for fields in ({}, {"order": "pairwise"}, {"compensated": True}):
                mac = MAC(accumulator=accumulator, rounding=rule, **fields)
                got = lpsim.mac.matmul(a, b, mac)
                assert_same_values(got, model_matmul(a, b, mac, 0, 0), str(mac))

"""A plain scalar model of NVIDIA's tensor cores, for the tests: written from the description in
Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor Cores" (arXiv:2512.07004), on Python
integers (significands and exponents), sharing no code with lpsim.

One multiply-accumulate step takes a group of operand pairs and the running value c:

- each operand x of a format with ``man`` fraction bits and smallest normal exponent ``emin`` is
  sig * 2^(exp - man) with exp = max(floor(log2 |x|), emin) and sig an integer;
- a product keeps its operands' exponent sum, exp_a + exp_b, unnormalised (sig_a sig_b < 4 * 2^(2
  man)); c is a binary32 value (sig * 2^(exp - 23), exp >= -126);
- E is the largest exponent of the nonzero products and c, at least the model's floor;
- every term is truncated toward zero to a multiple of 2^(E - F), the truncated terms are summed
  as integers, and the sum is normalised into the output format, round toward zero (float32
  output) or to nearest even (float16 output).

The tests compare this model with lpsim's exact reference and kernel, and with the GPUs' outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    group: int  # products per step
    fraction_bits: int  # F
    floor: int | None  # smallest E
    in_man: int  # operand format: fraction bits
    in_emin: int  # operand format: exponent of the smallest normal
    out_exp: int  # output format: exponent bits
    out_man: int  # output format: fraction bits
    rounding: str  # "rz" or "rne"
    promote: int | None = (
        None  # promotion into binary32 (round to nearest) every this many products
    )


FP16, BF16, TF32, E4M3, E5M2 = (10, -14), (7, -126), (10, -126), (3, -6), (2, -14)
OPERANDS = {"fp16": FP16, "bf16": BF16, "tf32": TF32, "e4m3": E4M3, "e5m2": E5M2}

# The paper's models: (group, F, floor) per GPU and operand format, float32 output, round toward
# zero. F is 23 plus the extra alignment bits: 0 on V100, 1 on A100, 2 on H100 and B200; H100's fp8
# step keeps 13 bits, and its result is a number of 13 fraction bits.
MODELS: dict[str, Model] = {}
for gpu, operands, group, f, floor in [
    ("V100", "fp16", 4, 23, None),
    ("A100", "fp16", 8, 24, -132),
    ("A100", "bf16", 8, 24, -132),
    ("A100", "tf32", 4, 24, -132),
    ("H100", "fp16", 16, 25, -133),
    ("H100", "bf16", 16, 25, -133),
    ("H100", "tf32", 8, 25, -133),
    ("H100", "e4m3", 32, 13, -133),
    ("H100", "e5m2", 32, 13, -133),
    ("B200", "fp16", 16, 25, -133),
    ("B200", "bf16", 16, 25, -133),
    ("B200", "tf32", 8, 25, -133),
    ("B200", "e4m3", 32, 25, -133),
    ("B200", "e5m2", 32, 25, -133),
]:
    out_man = 13 if (gpu, operands) in {("H100", "e4m3"), ("H100", "e5m2")} else 23
    MODELS[f"{gpu}/{operands}"] = Model(group, f, floor, *OPERANDS[operands], 8, out_man, "rz")
for gpu, floor in [("V100", -19), ("A100", -20), ("H100", -21), ("B200", -21)]:
    base = MODELS[f"{gpu}/fp16"]
    MODELS[f"{gpu}/fp16/fp16"] = Model(base.group, base.fraction_bits, floor, *FP16, 5, 10, "rne")
MODELS["DeepSeek-V3"] = Model(32, 13, -133, *E4M3, 8, 13, "rz", promote=128)


def decode(x: float, man: int, emin: int) -> tuple[int, int, int]:
    """(sign, sig, exp) with |x| = sig * 2^(exp - man), exp = max(floor(log2 |x|), emin)."""
    sign = 1 if math.copysign(1.0, x) < 0 else 0
    if x == 0:
        return sign, 0, emin
    mantissa, e = math.frexp(abs(x))  # |x| = mantissa * 2^e, mantissa in [0.5, 1)
    exp = max(e - 1, emin)
    scaled = math.ldexp(abs(x), man - exp)
    assert scaled == int(scaled), f"{x} has more than {man} fraction bits"
    return sign, int(scaled), exp


def normalise(total: int, q: int, out_exp: int, out_man: int, rounding: str) -> float:
    """total * 2^q rounded into the output format (subnormals kept, IEEE overflow)."""
    if total == 0:
        return 0.0
    m = abs(total)
    bias = 2 ** (out_exp - 1) - 1
    emin = 1 - bias
    top = max(m.bit_length() - 1 + q, emin)  # exponent of the result's binade
    ulp = top - out_man
    shift = ulp - q
    if shift <= 0:
        r = m << -shift
    else:
        r = m >> shift
        rest = m - (r << shift)
        half = 1 << (shift - 1)
        if rounding == "rne" and (rest > half or (rest == half and r % 2 == 1)):
            r += 1
    largest = (2 ** (out_man + 1) - 1) << (bias - out_man)  # max / 2^0, as an integer times 1
    value_exceeds = r * 2**ulp > largest if ulp >= 0 else r > largest * 2**-ulp
    if value_exceeds:
        magnitude = (
            math.inf if rounding == "rne" else math.ldexp(2 ** (out_man + 1) - 1, bias - out_man)
        )
    else:
        magnitude = math.ldexp(r, ulp)
    return -magnitude if total < 0 else magnitude


def step(a: list[float], b: list[float], c: float, model: Model) -> float:
    """One tensor-core step: c + sum a_i b_i as the model computes it."""
    products = [x * y for x, y in zip(a, b)]  # only for the exceptional cases
    values = products + [c]
    if any(math.isnan(v) for v in values):
        return math.nan
    if math.inf in values and -math.inf in values:
        return math.nan
    if math.inf in values or -math.inf in values:
        return math.inf if math.inf in values else -math.inf
    terms = []  # (sign, sig, weight of sig's last bit, alignment exponent)
    for x, y in zip(a, b):
        sx, gx, ex = decode(x, model.in_man, model.in_emin)
        sy, gy, ey = decode(y, model.in_man, model.in_emin)
        if gx and gy:
            terms.append((sx ^ sy, gx * gy, ex + ey - 2 * model.in_man, ex + ey))
    if c != 0:
        sc, gc, ec = decode(c, 23, -126)
        terms.append((sc, gc, ec - 23, ec))
    if not terms:
        return 0.0
    top = max(t[3] for t in terms)
    if model.floor is not None:
        top = max(top, model.floor)
    q = top - model.fraction_bits
    total = 0
    for sign, sig, weight, _ in terms:
        shift = weight - q
        aligned = sig << shift if shift >= 0 else sig >> -shift  # truncation of the magnitude
        total += -aligned if sign else aligned
    return normalise(total, q, model.out_exp, model.out_man, model.rounding)


def add_binary32_nearest(s: float, u: float) -> float:
    """s + u rounded to nearest even into binary32 (the promotion)."""
    if math.isnan(s) or math.isnan(u) or (math.isinf(s) and math.isinf(u) and s != u):
        return math.nan
    if math.isinf(s) or math.isinf(u):
        return s if math.isinf(s) else u
    q = -149 - 60
    total = 0
    for v in (s, u):
        sign, sig, exp = decode(v, 23 + 60, -126)  # binary32 values, on the grid of 2^-209
        total += (-sig if sign else sig) << (exp - 23 - 60 - q)
    return normalise(total, q, 8, 23, "rne")


def dot(a: list[float], b: list[float], model: Model) -> float:
    """The inner product of a and b: the steps chained from c = 0 in increasing k, and with a
    promotion every ``model.promote`` products, each promoted block's result added into a binary32
    sum rounded to nearest (the first block's result is the sum's first value)."""
    block = model.promote or max(len(a), 1)
    s = None
    for first in range(0, len(a), block):
        c = 0.0
        for start in range(first, min(first + block, len(a)), model.group):
            end = min(start + model.group, first + block, len(a))
            c = step(a[start:end], b[start:end], c, model)
        s = add_binary32_nearest(s, c) if model.promote and s is not None else c
    return 0.0 if s is None else s

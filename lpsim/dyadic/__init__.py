"""Integer-native arithmetic: dyadic numbers v * 2**-s with integer mantissas v and scales s.

Every data-path operation is an integer kernel (lpsim.dyadic.functional): aligning, adding,
multiplying with a quantisation shift, dividing with a precision shift, requantising to a b-bit
integer with stochastic or nearest rounding, and matrix products with a checked accumulator.
lpsim.dyadic.nn has integer layers with explicit backward passes and lpsim.dyadic.optim an SGD
whose learning rate and momentum are shifts. docs/integer.md describes the arithmetic.

    >>> import torch
    >>> from lpsim import dyadic
    >>> x = dyadic.from_float(torch.tensor([0.3, -1.7, 2.5]), bits=8).value
    >>> x.scale, x.mantissa.tolist()
    (5, [10, -54, 80])
    >>> y = dyadic.requantize(x, 2, bits=4, rounding="nearest")
    >>> y.value.mantissa.tolist(), y.clipped.tolist()
    ([1, -7, 7], [False, False, True])
"""

from lpsim.dyadic import functional, nn, optim, reference
from lpsim.dyadic.functional import (
    DyadicOverflowWarning,
    Requantized,
    Saturated,
    add,
    align,
    check_overflow,
    div,
    fit_shift,
    from_float,
    integer_range,
    matmul,
    mul,
    requantize,
    saturating_add,
    saturating_matmul,
    saturating_sub,
    saturating_sum,
    scale_for,
    sub,
    sum,  # noqa: A004 (as torch.sum)
)
from lpsim.dyadic.tensor import DyadicTensor

__all__ = ["DyadicTensor", *functional.__all__, "functional", "nn", "optim", "reference"]

"""Accumulation: sum, cumsum, matvec and matmul with rounding after every operation.

Each op evaluates its sums by recursive summation in a fixed, documented order and rounds every
partial sum into the accumulation format ``acc``, so that the rounding errors of low-precision
accumulators (and their growth with the length of the sum) can be measured:

    s_0 = round(t_0),   s_k = round(s_(k-1) + t_k)   for k = 1, ..., n - 1,

where each sum s_(k-1) + t_k is computed exactly before it is rounded, and the terms t_k are taken
in increasing index order (k is the index along the summed dimension, from 0). For sum and
cumsum the terms are the elements; for matvec and matmul they are the products a[i, k] * b[k, j],
formed exactly (the operands are float32, bfloat16 or float16, whose products float64 holds
exactly) and rounded into ``mul`` when it is given.

    >>> import torch, lpsim
    >>> x = torch.full((1000,), 1e-3)                                   # the sum is 1.00000005
    >>> lpsim.accumulate.sum(x, acc=lpsim.Float(5, 10)).item()                 # float16 accumulator
    0.978515625
    >>> lpsim.accumulate.sum(x, acc=lpsim.Float(8, 7)).item()                  # bfloat16: stagnates
    0.5
    >>> lpsim.accumulate.sum(x, acc=lpsim.Float(8, 7), rounding="stochastic", seed=0).item()
    0.9609375

``rounding`` applies to every rounding (``"nearest"`` by default); with a stochastic rule the
rounding that gives s_k of result r (results numbered from 0 in row-major order; k from 0, so
the first term's rounding, s_0 = round(t_0), is k = 0) draws word 2 (r n + k) of the
position-keyed Philox stream of (seed, offset), and the rounding of its product t_k word
2 (r n + k) + 1. The results are returned in the input's dtype when ``acc`` fits it, else in
float32 when ``acc`` fits float32, else in float64; always in float64 for a Fixed ``acc`` without
clamp, whose sums may leave its range on a grid that no narrower tensor holds.

The ops have no derivative: with grad mode on and an input that requires grad, a backward pass
that reaches a result raises RuntimeError (lpsim.nn.functional's products, under an lpsim.MAC,
have gradients).

These ops are written for correctness, not speed: one CPU loop, about 30 ns per multiply-add on a
2-core x86 machine. They run on CPU tensors only.
"""

from __future__ import annotations

import math

import torch

from lpsim._checks import (
    check_bool,
    check_container,
    check_element_format,
    check_strided,
    check_tensor,
    random_args,
)
from lpsim._ops import call
from lpsim.formats import Fixed, Float, check_fits, sum_container
from lpsim.rounding import Rounding
from lpsim.update import own_format, sum_grid

__all__ = ["sum", "cumsum", "matvec", "matmul"]

PRODUCT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # products exact in float64


def _check_input(x, name: str) -> None:
    check_container(x, name)
    check_strided(x, name, "lpsim.accumulate")
    if x.device.type != "cpu":
        raise ValueError(f"lpsim.accumulate runs on CPU tensors only; {name} is on {x.device}")


def _check_format(fmt, name: str, dtype: torch.dtype | None) -> Float | Fixed | None:
    if fmt is None:
        return own_format(dtype) if dtype is not None else None
    check_element_format(name, fmt)
    check_fits(fmt, torch.float64)
    return fmt


def _random_args(rounding, rbits, seed, offset) -> tuple:
    rule, *random = random_args(rounding, rbits, seed, offset)
    return (int(rule), *random)


def _dim_of(dim, x: torch.Tensor) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"dim must be in [{-ndim}, {ndim - 1}] for a tensor of {x.dim()} dimensions, got {dim}"
        )
    return dim % ndim


def _reduce(x, dim, cumulative, acc, rounding, rbits, seed, offset):
    """(float64 result of sum_rounded, outer, n, inner, acc)."""
    _check_input(x, "x")
    acc = _check_format(acc, "acc", x.dtype)
    args = _random_args(rounding, rbits, seed, offset)
    shape = tuple(x.shape)
    if dim is None:
        outer, n, inner = 1, x.numel(), 1
    else:
        d = _dim_of(dim, x)
        shape = shape or (1,)
        outer, n, inner = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :])
        if inner == 0:  # no results: an empty dimension after dim (the op counts inner >= 1)
            outer, inner = 0, 1
    grid = sum_grid(acc, sum_container(acc, x.dtype))
    y = call("sum_rounded", x.contiguous(), outer, n, inner, cumulative, *grid, *args)
    return y, acc


def sum(
    x: torch.Tensor,
    dim: int | None = None,
    *,
    keepdim: bool = False,
    acc: Float | Fixed | None = None,
    rounding: Rounding | str = "nearest",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """The sum of x's elements along ``dim`` (all of them, in row-major order, for None) by
    recursive summation in increasing index order, each partial sum rounded into ``acc``.

    Args:
        x: a float32, float64, bfloat16 or float16 CPU tensor.
        dim: the dimension to sum over; None: every element.
        keepdim: keep the summed dimension with size 1 (every dimension for dim None), as
            torch.sum does.
        acc: a Float, Fixed or P3109 accumulation format; None: x's own format (a bfloat16
            tensor is summed in bfloat16).
        rounding, rbits, seed, offset: as for lpsim.quantize; the default rule is "nearest".

    Returns:
        The sums, in x's dtype when acc fits it, else float32 or float64. The sum of no elements
        is +0.

    Raises:
        TypeError: x is not a tensor of a supported dtype, acc is not a Float, Fixed or P3109
            format, or keepdim is not a bool.
        ValueError: x is not on the CPU, or an argument is out of range.
        IndexError: dim does not exist in x.
    """
    check_bool("keepdim", keepdim)
    y, acc = _reduce(x, dim, False, acc, rounding, rbits, seed, offset)
    out = call("to_container", y, sum_container(acc, x.dtype))
    if dim is None:  # as torch.sum(x, None, keepdim): every dimension summed
        return out.reshape((1,) * x.dim() if keepdim else ())
    if x.dim() == 0:
        return out.reshape(())
    d = _dim_of(dim, x)
    shape = list(x.shape)
    shape[d] = 1
    out = out.reshape(shape)
    return out if keepdim else out.squeeze(d)


def cumsum(
    x: torch.Tensor,
    dim: int,
    *,
    acc: Float | Fixed | None = None,
    rounding: Rounding | str = "nearest",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """The partial sums of x along ``dim``, each rounded into ``acc``: element k along dim is the
    partial sum s_k of sum(x, dim) (same order, same roundings, same random words). Arguments
    (default rounding "nearest") and errors as for sum. Returns a tensor of x's shape."""
    _check_input(x, "x")
    _dim_of(dim, x)  # required: None (sum's every element) is not a dimension here
    y, acc = _reduce(x, dim, True, acc, rounding, rbits, seed, offset)
    return call("to_container", y, sum_container(acc, x.dtype)).reshape(x.shape)


def _dot(a, b_rows, x_dtype, acc, mul, rounding, rbits, seed, offset):
    """dot_rounded of a (m, n) with the rows of b_rows (p, n), in the result dtype."""
    acc = _check_format(acc, "acc", x_dtype)
    mul = _check_format(mul, "mul", None)
    args = _random_args(rounding, rbits, seed, offset)
    out_dtype = sum_container(acc, x_dtype)
    acc_grid = sum_grid(acc, out_dtype)
    # Products are rounded in float64, the container they are exact in.
    mul_grid = sum_grid(mul, torch.float64) if mul is not None else acc_grid  # unused without mul
    y = call(
        "dot_rounded",
        a.contiguous(),
        b_rows.contiguous(),
        mul is not None,
        *mul_grid,
        *acc_grid,
        *args,
    )
    return call("to_container", y, out_dtype)


def matvec(
    a: torch.Tensor,
    x: torch.Tensor,
    *,
    acc: Float | Fixed | None = None,
    mul: Float | Fixed | None = None,
    rounding: Rounding | str = "nearest",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """y = a @ x with y[i] the recursive sum over j = 0, 1, ... of the exact products a[i, j] x[j]
    (each rounded into ``mul`` when given), every partial sum rounded into ``acc``.

    Args:
        a: an (m, n) float32, bfloat16 or float16 CPU tensor.
        x: an (n,) tensor of a's dtype.
        acc: the accumulation format; None: a's own format.
        mul: the format products are rounded into; None: products are exact (each step is then a
            fused multiply-add).
        rounding, rbits, seed, offset: as for sum; the default rule is "nearest".

    Returns:
        y of shape (m,), in a's dtype when acc fits it, else float32 or float64.

    Raises:
        TypeError: an operand has an unsupported dtype (float64 products would not be exact) or
            a sparse layout, or the operands' dtypes differ; a format is not a Float, Fixed or
            P3109.
        ValueError: the shapes do not match, an operand is not on the CPU, or an argument is out of
            range.
    """
    for name, operand in (("a", a), ("x", x)):
        check_tensor(operand, name)
        check_strided(operand, name, "lpsim.accumulate")
    if x.dim() != 1 or a.dim() != 2 or a.shape[1] != x.shape[0]:
        raise ValueError(
            f"matvec takes a of shape (m, n) and x of shape (n,), got {tuple(a.shape)} and "
            f"{tuple(x.shape)}"
        )
    # The product with one column numbers its results as matvec does: r = i.
    return _product(
        a, x.reshape(-1, 1), ("a", "x"), acc, mul, rounding, rbits, seed, offset
    ).reshape(-1)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    acc: Float | Fixed | None = None,
    mul: Float | Fixed | None = None,
    rounding: Rounding | str = "nearest",
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """c = a @ b for a (m, n) and b (n, p): c[i, j] is computed as matvec computes y[i], over
    k = 0, 1, ..., n - 1. Results are numbered r = i p + j for the random words. Arguments
    (default rounding "nearest"), result dtype and errors as for matvec."""
    return _product(a, b, ("a", "b"), acc, mul, rounding, rbits, seed, offset)


def _product(a, b, names, acc, mul, rounding, rbits, seed, offset):
    """matmul's checks (naming the operands `names` in messages), then _dot."""
    for name, operand in zip(names, (a, b)):
        check_tensor(operand, name)
        check_strided(operand, name, "lpsim.accumulate")
    check_product_operands(a, b, names, "lpsim.accumulate")
    return _dot(a, b.t(), a.dtype, acc, mul, rounding, rbits, seed, offset)


def check_product_operands(
    a, b, names: tuple[str, str], where: str, devices: tuple[str, ...] = ("cpu",)
) -> None:
    """The operands of a matrix product whose products are formed exactly, checked: a (M, K) and
    b (K, N) tensors of one dtype, float32, bfloat16 or float16, on one device of a type in
    `devices` (`names` name them and `where` the caller in messages).

    Raises:
        TypeError: an operand has another dtype, or the dtypes differ.
        ValueError: the shapes do not match, or an operand is on another device.
    """
    first, second = names
    for name, x in ((first, a), (second, b)):
        check_container(x, name, PRODUCT_DTYPES)
        if x.device.type not in devices:
            allowed = " or ".join(d.upper() for d in devices)
            raise ValueError(f"{where} runs on {allowed} tensors only; {name} is on {x.device}")
    if b.device != a.device:
        raise ValueError(f"{second} must be on {first}'s device ({a.device}), got {b.device}")
    if b.dtype != a.dtype:
        raise TypeError(f"{second} must have {first}'s dtype ({a.dtype}), got {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"matmul takes {first} of shape (m, n) and {second} of shape (n, p), got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )

"""Quantisation functions: the only module that calls the compiled ops.

``quantize(x, fmt, rounding)`` returns a tensor of x's dtype and shape whose every element is a
value of ``fmt``: x rounded by the rule (see lpsim.rounding). It is differentiable with the
straight-through gradient (the gradient passes unchanged). ``quantize_`` rounds in place.

Randomness. The stochastic rules draw one 32-bit word per element from Philox4x32-10 keyed by
(seed, offset) and the element's position in x (row-major, whatever x's strides), so the result
does not depend on the thread count, the memory layout or the device. Without ``seed``, a seed is
drawn from torch's default CPU generator, so ``torch.manual_seed`` makes runs reproducible.
``offset`` selects a disjoint stream under the same seed. Under torch.compile with Inductor that
draw is a random op of the graph, generated Inductor's way: reproducible under
``torch.manual_seed``, but other seeds than eager's unless
``torch._inductor.config.fallback_random`` is set (an explicit ``seed`` rounds alike in both);
Inductor's CPU kernel keys that draw with 32 random bits, so compiled seeds take at most 2**32
values (docs/rounding.md).

Under torch.compile, Float, Fixed and P3109 formats with a deterministic rule are rounded by
lpsim.fusable's torch-op form of the same rounding (bit for bit the kernel's), which Inductor fuses
into the kernel that produces x; eager calls run the C++ kernel.
"""

from __future__ import annotations

import torch

from lpsim._checks import (
    check_container,
    check_strided,
    check_tensor,
    draws_seed_in_python,
    random_args,
)
from lpsim._ops import call, call_in_place
from lpsim.formats import GRID_FORMATS, BlockFloat, Format, check_fits
from lpsim.fusable import compiled_quantize, compiled_quantize_
from lpsim.rounding import MAX_RBITS, Rounding
from lpsim.scaled import Scaled

__all__ = ["quantize", "quantize_"]

_STRIDED = torch.strided  # a module global: the fast path below reads it on every call


def _block_dim(fmt: BlockFloat, x: torch.Tensor) -> int | None:
    if fmt.dim is None:
        return None
    ndim = max(x.dim(), 1)
    if not fmt.dim < ndim:
        raise IndexError(
            f"BlockFloat.dim must be in [0, {ndim - 1}] for a tensor of {x.dim()} "
            f"dimensions, got {fmt.dim}"
        )
    return fmt.dim


def quantize_op_arguments(x, fmt, rounding, rbits, seed, offset):
    """The op that quantize(x, fmt, rounding, ...) calls and its validated arguments: (op name,
    arguments after x), for the modules that call variants of the same op (lpsim.statistics).

    The common call, a grid format (Float, Fixed, P3109) already used with x's dtype, a rule and
    no rbits, seed or offset, costs a few dictionary look-ups (the rest of a call is
    lpsim._ops.call)."""
    if isinstance(x, torch.Tensor) and isinstance(fmt, GRID_FORMATS):
        grid = fmt.stored_grid_arguments(x.dtype)  # stored only for dtypes that passed the checks
        if (
            grid is not None
            and rbits is None
            and seed is None
            and type(offset) is int
            and x.layout is _STRIDED  # others are refused below (check_strided)
            and not x.is_nested
        ):
            default = _DEFAULT_RANDOM.get(rounding) if type(rounding) in (str, Rounding) else None
            if default is not None and offset == 0:
                random, stochastic = default
                # While torch.compile traces, and under torch.func, seed_argument draws the seed.
                if not (stochastic and draws_seed_in_python()):
                    return "quantize_grid", grid + random
    check_tensor(x)
    check_strided(x, "x", "quantize")
    if isinstance(fmt, GRID_FORMATS):
        check_container(x)
        grid = fmt.grid_arguments(x.dtype)
        rule, *random = random_args(rounding, rbits, seed, offset, x)
        return "quantize_grid", (*grid, int(rule), *random)
    if isinstance(fmt, Scaled):
        check_container(x)
        arguments = fmt.op_arguments(x.dtype)
        rule, *random = random_args(rounding, rbits, seed, offset, x)
        return "quantize_scaled", (*arguments, int(rule), *random)
    if not isinstance(fmt, BlockFloat):
        raise TypeError(
            f"fmt must be a Float, Fixed, P3109, BlockFloat or Scaled format, "
            f"got {type(fmt).__name__}"
        )
    check_container(x)
    check_fits(fmt, x.dtype)
    rule, *random = random_args(rounding, rbits, seed, offset, x)
    return "quantize_block", (fmt.wl, _block_dim(fmt, x), fmt.block_size, int(rule), *random)


# For each rule, by name and as a Rounding: the arguments after the grid with rbits, seed and
# offset at their defaults, (rule, 32 bits, no seed, offset 0), and whether the rule is stochastic.
_DEFAULT_RANDOM = {
    key: ((int(rule), MAX_RBITS, None, 0), rule.is_stochastic)
    for rule in Rounding
    for key in (rule.name, rule)
}


def quantize(
    x: torch.Tensor,
    fmt: Format,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x rounded into ``fmt`` by ``rounding``, in a tensor of x's dtype and shape.

    Args:
        x: a float32, float64, bfloat16 or float16 tensor, any shape and strides. Its dtype is the
            container: the format must fit it (see lpsim.formats).
        fmt: a Float, Fixed, P3109, BlockFloat or Scaled format.
        rounding: a rule name or lpsim.Rounding (see lpsim.rounding); default "nearest".
        rbits: random bits per decision, 1 to 32, for the stochastic rules only (default 32).
        seed: 0 <= seed < 2**64, for the stochastic rules. None: drawn from torch's default CPU
            generator.
        offset: 0 <= offset < 2**64: the random stream under the seed.
        out: a tensor of x's shape and dtype to write into; returned. It may be x itself (x is
            then rounded in place, as by quantize_), but not a tensor that shares only part of
            x's memory (RuntimeError, as torch's out= functions: clone x first). sr_add_, whose
            operand b is read from a copy when it overlaps a, differs here. A view with torch's
            negative bit (z.conj().imag) reads the rounded values, as with torch's out=.

    Returns:
        A new contiguous tensor (or ``out``). The gradient with respect to x is the identity
        (straight-through), in reverse mode and in forward mode (a dual tensor's tangent, under
        torch.autograd.forward_ad, torch.func.jvp, jacfwd or hessian, passes unchanged), to
        any order; with ``out`` the call is not differentiable: as torch's out= functions, it
        refuses x or out that requires grad while grad mode is on, and a dual x or out
        (NotImplementedError). Writing into ``out`` bumps its version counter, as torch's
        in-place ops do.

    Raises:
        TypeError: x is not a strided floating tensor of a supported dtype (a sparse, nested
            or MKL-DNN tensor is refused), fmt is not a format, or an argument has the wrong
            type.
        ValueError: the format does not fit x's dtype, or an argument is out of range.
        IndexError: a BlockFloat dim does not exist in x.
        RuntimeError: ``out`` is given and x or out requires grad, outside torch.no_grad();
            ``out`` has another shape, dtype or device than x, or shares part, not all, of x's
            memory.
    """
    if torch.compiler.is_compiling():  # the fusable form, where there is one (lpsim.fusable)
        fused = compiled_quantize(x, fmt, rounding, rbits=rbits, seed=seed, offset=offset, out=out)
        if fused is not None:
            return fused
    name, args = quantize_op_arguments(x, fmt, rounding, rbits, seed, offset)
    if out is None:
        return call(name, x, *args)
    check_tensor(out, "out")
    check_strided(out, "out", "quantize")
    if out.device != x.device:
        # The compiled kernels check it too, but a meta tensor among x and out dispatches to the
        # shape-only kernel, which would leave out unwritten.
        raise RuntimeError(f"out must be on the device of x, {x.device}, got {out.device}")
    call_in_place(name + "_out", x, *args, out, written=-1)  # (an out with the negative bit)
    return out


def quantize_(
    x: torch.Tensor,
    fmt: Format,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Round x into ``fmt`` in place and return x. Arguments (default rounding "nearest") and
    errors as for quantize().

    Under autograd it behaves as torch's in-place ops: x's version counter is bumped (in
    torch.no_grad() too), so a backward that saved x's old values raises instead of using the
    rounded ones; outside torch.no_grad() a leaf that requires grad, or a view of one, is refused
    with RuntimeError. Rounding a non-leaf keeps its history: the gradient through x stays the
    identity (straight-through).
    """
    if torch.compiler.is_compiling():
        if compiled_quantize_(x, fmt, rounding, rbits=rbits, seed=seed, offset=offset) is not None:
            return x
    name, args = quantize_op_arguments(x, fmt, rounding, rbits, seed, offset)
    call_in_place(name + "_", x, *args)
    return x

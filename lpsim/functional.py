"""Quantisation functions: the only module that calls the compiled ops.

``quantize(x, fmt, rounding)`` returns a tensor of x's dtype and shape whose every element is a
value of ``fmt``: x rounded by the rule (see lpsim.rounding). It is differentiable with the
straight-through gradient (the gradient passes unchanged). ``quantize_`` rounds in place.

Randomness. The stochastic rules draw one 32-bit word per element from Philox4x32-10 keyed by
(seed, offset) and the element's position in x (row-major, whatever x's strides), so the result
does not depend on the thread count, the memory layout or the device. Without ``seed``, a seed is
drawn from torch's default CPU generator, so ``torch.manual_seed`` makes runs reproducible.
``offset`` selects a disjoint stream under the same seed.
"""

from __future__ import annotations

import torch

from lpsim._ops import ops
from lpsim.formats import BlockFloat, Fixed, Float, Format, check_fits
from lpsim.rounding import Rounding, check_rbits

__all__ = ["quantize", "quantize_"]

_MAX_SEED = 2**64
_NO_SEED = torch.zeros((), dtype=torch.int64)  # passed to rules that draw no random words


def _seed_tensor(seed: int | None, rounding: Rounding) -> torch.Tensor:
    """The seed as the ops take it: a one-element int64 CPU tensor holding the 64 seed bits."""
    if not rounding.is_stochastic:
        return _NO_SEED
    if seed is None:  # 63 random bits from torch's default CPU generator
        return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return torch.tensor(seed - _MAX_SEED if seed >= 2**63 else seed, dtype=torch.int64)


def _check_offset(offset: int) -> int:
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if not 0 <= offset < _MAX_SEED:
        raise ValueError(f"offset must be in [0, 2**64), got {offset}")
    return offset - _MAX_SEED if offset >= 2**63 else offset


def _check_tensor(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


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


def _prepare(x, fmt, rounding, rbits, seed, offset):
    """Validated op arguments: (op name, arguments after x)."""
    _check_tensor(x)
    if not isinstance(fmt, (Float, Fixed, BlockFloat)):
        raise TypeError(f"fmt must be a Float, Fixed or BlockFloat, got {type(fmt).__name__}")
    if x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be a float32, float64, bfloat16 or float16 tensor, got {x.dtype}")
    check_fits(fmt, x.dtype)
    rule = Rounding.parse(rounding)
    random = (check_rbits(rbits, rule), _seed_tensor(seed, rule), _check_offset(offset))
    if isinstance(fmt, BlockFloat):
        return "quantize_block", (fmt.wl, _block_dim(fmt, x), fmt.block_size, int(rule)) + random
    return "quantize_grid", tuple(fmt.grid()) + (int(rule),) + random


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
        fmt: a Float, Fixed or BlockFloat format.
        rounding: a rule name or lpsim.Rounding (see lpsim.rounding).
        rbits: random bits per decision, 1 to 32, for the stochastic rules only (default 32).
        seed: 0 <= seed < 2**64, for the stochastic rules. None: drawn from torch's default CPU
            generator.
        offset: 0 <= offset < 2**64: the random stream under the seed.
        out: a tensor of x's shape and dtype to write into; returned.

    Returns:
        A new contiguous tensor (or ``out``). The gradient with respect to x is the identity
        (straight-through); with ``out`` the call is not differentiable: as torch's out=
        functions, it refuses x or out that requires grad while grad mode is on. Writing into
        ``out`` bumps its version counter, as torch's in-place ops do.

    Raises:
        TypeError: x is not a floating tensor of a supported dtype, fmt is not a format, or an
            argument has the wrong type.
        ValueError: the format does not fit x's dtype, or an argument is out of range.
        IndexError: a BlockFloat dim does not exist in x.
        RuntimeError: ``out`` is given and x or out requires grad, outside torch.no_grad().
    """
    name, args = _prepare(x, fmt, rounding, rbits, seed, offset)
    if out is None:
        return getattr(ops, name)(x, *args)
    _check_tensor(out, "out")
    getattr(ops, name + "_out")(x, *args, out=out)
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
    """Round x into ``fmt`` in place and return x. Arguments as for quantize().

    Under autograd it behaves as torch's in-place ops: x's version counter is bumped (in
    torch.no_grad() too), so a backward that saved x's old values raises instead of using the
    rounded ones; outside torch.no_grad() a leaf that requires grad, or a view of one, is refused
    with RuntimeError. Rounding a non-leaf keeps its history: the gradient through x stays the
    identity (straight-through).
    """
    name, args = _prepare(x, fmt, rounding, rbits, seed, offset)
    getattr(ops, name + "_")(x, *args)
    return x

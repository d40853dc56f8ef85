"""Rounding many tensors in one call: ``quantize_many_(tensors, fmt, rounding)``.

One compiled call rounds every tensor of a list in place, where a loop of ``quantize_`` pays the
per-call cost (argument checks, dispatch, a parallel region or a kernel launch) once per tensor:
for the hundreds of small tensors of a model's parameters, gradients and optimizer states, that
cost dominates. On the CPU all elements of all tensors are one parallel region; on CUDA one launch
rounds a chunk of up to 48 tensors of one dtype.

Randomness. Tensor number i draws its random words from the stream ``offset + i`` under the seed,
so it is rounded exactly (bit for bit) as ``quantize_(tensors[i], fmt, rounding, rbits=rbits,
seed=seed, offset=offset + i)`` rounds it. Without ``seed``, one seed is drawn for the whole call
from torch's default CPU generator, as one ``quantize_`` call draws it: after the same
``torch.manual_seed``, ``quantize_many_([x], fmt, "stochastic")`` rounds x as ``quantize_(x, fmt,
"stochastic")`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lpsim._checks import MAX_SEED, check_container, check_strided, draw_seed, random_args
from lpsim._ops import call, call_in_place
from lpsim.formats import GRID_FORMATS, BlockFloat, Format
from lpsim.functional import quantize_op_arguments
from lpsim.rounding import Rounding
from lpsim.scaled import Scaled

__all__ = ["quantize_many_"]


def _checked_tensors(tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_container(t, f"tensors[{i}]")
        check_strided(t, f"tensors[{i}]", "quantize_many_")
        if t.numel() > 1 and any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
            # Checked here, before any tensor is rounded (the op met it after rounding others).
            raise RuntimeError(
                f"tensors[{i}] has elements that share one memory location (a stride of 0, as "
                "expand() gives): it cannot be rounded in place; clone() it first"
            )
        if t.device != tensors[0].device:
            raise ValueError(
                f"tensors[{i}] is on {t.device} and tensors[0] on {tensors[0].device}: "
                "all must be on one device"
            )
        if not torch.compiler.is_compiling():
            _check_in_place(t, i)
    return tensors


def _check_in_place(t: torch.Tensor, i: int) -> None:
    """Refuse, as torch refuses an in-place op on it, a leaf that requires grad or a view of one,
    outside torch.no_grad()."""
    if torch.is_grad_enabled() and t.requires_grad:
        base = t if t._base is None else t._base
        if base.is_leaf:
            raise RuntimeError(
                f"tensors[{i}] is a leaf Variable that requires grad (or a view of one); it "
                "cannot be rounded in place outside torch.no_grad()"
            )


def _grid_arguments(fmt: Format, tensors: list[torch.Tensor]) -> tuple:
    """fmt's grid as the op takes it, after checking that fmt fits every tensor's dtype."""
    grid = ()
    for i, t in enumerate(tensors):
        try:
            grid = fmt.grid_arguments(t.dtype)
        except ValueError as error:
            raise ValueError(f"tensors[{i}]: {error}") from None
    return grid


def quantize_many_(
    tensors: Sequence[torch.Tensor],
    fmt: Format,
    rounding: Rounding | str = "nearest",
    *,
    rbits: int | None = None,
    seed: int | None = None,
    offset: int = 0,
) -> Sequence[torch.Tensor]:
    """Round every tensor of ``tensors`` into ``fmt`` in place; returns ``tensors``.

    Tensor i is rounded exactly as ``quantize_(tensors[i], fmt, rounding, rbits=rbits, seed=seed,
    offset=offset + i)`` would round it (see the module documentation for the random streams).

    Args:
        tensors: a list or tuple of float32, float64, bfloat16 or float16 strided (not sparse)
            tensors on one device;
            dtypes, shapes and strides may differ, tensors may be empty, the list may be empty.
            Each tensor's dtype is its container: the format must fit it. The tensors must not
            overlap in memory: they are rounded concurrently. Each one's memory is taken as the
            bytes from its first to past its last element, so the same tensor twice, two views
            that share elements, and also interleaved views such as x[::2] and x[1::2] are
            refused (round those in separate calls).
        fmt: a Float, Fixed, P3109, BlockFloat or Scaled format. Float, Fixed and P3109 formats
            round every tensor in one compiled call; BlockFloat and Scaled formats are a loop of
            ``quantize_`` over the tensors, with the same seed and offsets, and so is a list
            that holds a view with torch's negative bit (``z.conj().imag``).
        rounding: a rule name or lpsim.Rounding (see lpsim.rounding); default "nearest".
        rbits: random bits per decision, 1 to 32, for the stochastic rules only (default 32).
        seed: 0 <= seed < 2**64, for the stochastic rules. None: one seed drawn from torch's
            default CPU generator for the whole call (none for the deterministic rules).
        offset: the stream of tensor 0; tensor i uses ``offset + i``. 0 <= offset and
            offset + len(tensors) - 1 < 2**64. Calls under one seed share no stream only if
            their ranges [offset, offset + len(tensors)) do not meet: advance offset by
            len(tensors) from call to call (with offset = step, tensor i + 1 of one step would
            draw the words of tensor i of the next, position for position).

    Under autograd it behaves as ``quantize_``: every tensor's version counter is bumped, and
    outside torch.no_grad() a leaf that requires grad, or a view of one, is refused.

    Raises:
        TypeError: tensors is not a list or tuple, or tensors[i] is not a strided tensor of a
            supported dtype (the message names tensors[i]); fmt is not a format; an argument has
            the wrong type.
        ValueError: the format does not fit tensors[i]'s dtype (the message names tensors[i]), the
            tensors are on different devices, two of them overlap in memory (the message names
            both), or an argument is out of range.
        IndexError: a BlockFloat dim does not exist in a tensor.
        RuntimeError: a tensor is a leaf that requires grad (or a view of one) in grad mode, or
            has elements that share one memory location (an expanded tensor).
    """
    checked = _checked_tensors(tensors)
    rule, op_rbits, seed_argument, stream = random_args(rounding, rbits, seed, offset)
    if len(checked) > 1 and offset + len(checked) - 1 >= MAX_SEED:
        raise ValueError(
            f"offset + len(tensors) - 1 must be < 2**64: tensor i uses the stream offset + i; "
            f"got offset {offset} for {len(checked)} tensors"
        )
    if isinstance(fmt, (BlockFloat, Scaled)) or any(t.is_neg() for t in checked):
        # One loop of quantize_'s op under one seed: the one given, or one drawn here for all. The
        # tensors must not overlap there either (the op's check, on real tensors). A list holding
        # a view with torch's negative bit (z.conj().imag) takes this loop for every format:
        # torch's fallback for such views, which writes the results through the view, takes one
        # tensor, not a list, so the one compiled call of the grid formats raised.
        if not torch.compiler.is_compiling():
            call("_check_disjoint", checked)
        # The call's one seed: the one given; else the one random_args drew while torch.compile
        # traces (a tensor of the graph, passed on as it is: drawing a second one shifted every
        # later draw where random ops are kept, and int() of it broke the graph, behind which
        # torch returned an alias of a caller's tensor for the rounded one); else one drawn here.
        traced = seed_argument if rule.is_stochastic and seed is None else None
        if rule.is_stochastic and seed is None and traced is None:
            seed = int(draw_seed())
        # Every tensor checked before any is rounded, as the one compiled call of the grid
        # formats checks them: an error leaves all the tensors unchanged and names tensors[i].
        # The op arguments computed by the checks are those quantize_ would compute (these
        # formats have no fusable form), so each tensor's op is called with them.
        calls = []
        for i, t in enumerate(checked):
            try:
                name, args = quantize_op_arguments(
                    t, fmt, rule, rbits, 0 if traced is not None else seed, offset + i
                )
            except (ValueError, IndexError) as error:
                raise type(error)(f"tensors[{i}]: {error}") from None
            if traced is not None:  # the ops take (..., rule, rbits, seed, offset) last
                args = (*args[:-2], traced, args[-1])
            calls.append((name, args))
        for t, (name, args) in zip(checked, calls, strict=True):
            call_in_place(name + "_", t, *args)
        return tensors
    if not isinstance(fmt, GRID_FORMATS):
        raise TypeError(
            f"fmt must be a Float, Fixed, P3109, BlockFloat or Scaled format, "
            f"got {type(fmt).__name__}"
        )
    if checked:
        grid = _grid_arguments(fmt, checked)
        call("quantize_grid_many_", checked, *grid, int(rule), op_rbits, seed_argument, stream)
    elif rule.is_stochastic and seed is None and seed_argument is None:
        draw_seed()  # the call's one seed, which the op would draw, as for the formats above
    return tensors


@torch.library.register_fake("lpsim::quantize_grid_many_")
def _quantize_grid_many_fake(xs, *args):
    return None

"""StochasTorch's names on lpsim's kernels: ``StochasticAdder(float_type, seed=None).add(x, y)``.

StochasTorch's first interface offers stochastic addition into one dtype through an adder object,
``StochasticAdder(float_type, seed=None)`` with ``add`` and ``add_biased``; this module gives the
same object, with the same signature, over ``lpsim.sr_add``, so that a StochasTorch user changes one
import. StochasTorch's later module functions ``add(x, y, is_biased)``, ``add_highprecision`` and
``addcdiv`` are not provided; they correspond to ``lpsim.sr_add`` and ``lpsim.sr_addcdiv`` with
rounding="stochastic" (is_biased=True) or "stochastic_equal" (is_biased=False):

    >>> import torch
    >>> from lpsim.compat.stochastorch import StochasticAdder
    >>> adder = StochasticAdder(torch.bfloat16, seed=0)
    >>> w = torch.ones(4, dtype=torch.bfloat16)
    >>> adder.add_biased(w, 1e-3).dtype
    torch.bfloat16
"""

from __future__ import annotations

import torch

from lpsim._checks import (
    check_container,
    check_int,
    check_randomness,
    check_strided,
    draw_seed,
    seed_argument,
)
from lpsim.rounding import Rounding
from lpsim.update import own_format, sr_add

__all__ = ["StochasticAdder"]


class StochasticAdder:
    """Stochastic additions into one dtype, with the names StochasTorch users know.

    ``add(x, y)`` rounds the exact sum up or down with probability 1/2 each ("mode 2",
    rounding="stochastic_equal"). ``add_biased(x, y)`` rounds up with probability proportional to
    the distance from the value below ("mode 1", rounding="stochastic"); StochasTorch calls this the
    *biased* random choice because the coin is weighted, but it is the one that is **unbiased in
    expectation**: E[add_biased(x, y)] = x + y exactly, while E[add(x, y)] is the midpoint of the
    two neighbours of x + y, which differs from x + y by up to half a spacing. Use ``add_biased``
    to accumulate small updates.

    x and y (StochasTorch's parameter names, so that calls by keyword carry over) are tensors of
    any supported dtype (y may also be a Python number) and broadcast together as in torch's
    addition; the result has the broadcast shape.

    Every call draws fresh random words: the adder keeps a seed (given, or drawn from torch's
    default CPU generator when the adder is made) and counts its calls as the offset. Both are
    state of the run: ``state_dict()`` returns them and ``load_state_dict()`` restores them, so a
    run resumed from a checkpoint continues the random streams of the run it continues (a new
    adder with the same seed starts again from offset 0, and would repeat the words of the first
    calls).

    Where StochasTorch differs: it takes only operands of the adder's dtype (RuntimeError
    otherwise); its random choice is a hash of the operands' values, so the same operands always
    round the same way; and its ``add`` moves an exact sum one step toward -Inf with probability
    1/2 (its ``add_biased`` does so when both operands are equal), where here every exact sum is
    returned unchanged.

    Args:
        float_type: torch.float32, float64, bfloat16 or float16: results are rounded into this
            dtype's format and returned in it (also the attribute ``dtype``).
        seed: 0 <= seed < 2**64, or None (StochasTorch also takes negative seeds).
        randomness: "position" or "value" (see lpsim.sr_add). Under both, add(x, y) and
            add(y, x) round alike.

    Raises:
        TypeError: float_type is not a supported floating dtype, or seed is not an int or None.
        ValueError: seed or randomness is out of range.
    """

    def __init__(
        self, float_type: torch.dtype, seed: int | None = None, *, randomness: str = "position"
    ) -> None:
        try:
            self.format = own_format(float_type)
        except TypeError as error:
            raise TypeError(str(error).replace("dtype", "float_type", 1)) from None
        self.dtype = self.float_type = float_type
        check_randomness(randomness)
        self.randomness = randomness
        if seed is None:
            seed = int(draw_seed())
        seed_argument(seed, Rounding.stochastic)  # validates
        self.seed = seed
        self.calls = 0

    def __repr__(self) -> str:
        return f"StochasticAdder({self.dtype}, seed={self.seed}, randomness={self.randomness!r})"

    def state_dict(self) -> dict:
        """The seed and the number of calls made (the next call's offset), as Python ints."""
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned: the next call draws the words that the saved
        adder's next call would have drawn.

        Raises:
            KeyError: an entry is missing.
            TypeError, ValueError: the seed is not an int in [0, 2**64), or calls not an int in
                [0, 2**64).
        """
        missing = [key for key in ("seed", "calls") if key not in state_dict]
        if missing:
            raise KeyError(f"state_dict lacks {', '.join(missing)}")
        seed, calls = state_dict["seed"], state_dict["calls"]
        if seed is None:
            raise TypeError("state_dict['seed'] must be an int in [0, 2**64), got None")
        try:
            seed_argument(seed, Rounding.stochastic)  # validates
        except (TypeError, ValueError) as error:
            raise type(error)(f"state_dict['seed']: {error}") from None
        self.seed = seed
        self.calls = check_int("state_dict['calls']", calls, 0, 2**64 - 1)

    def _add(self, a: torch.Tensor, b: torch.Tensor | float, rounding: str) -> torch.Tensor:
        # The messages name StochasTorch's parameters: a is add's x, b its y.
        check_container(a, "x")
        check_strided(a, "x", "StochasticAdder")
        if isinstance(b, torch.Tensor):
            check_container(b, "y")
            check_strided(b, "y", "StochasticAdder")
            try:
                shape = torch.broadcast_shapes(a.shape, b.shape)
            except RuntimeError:
                raise ValueError(
                    f"x of shape {tuple(a.shape)} and y of shape {tuple(b.shape)} cannot be "
                    "broadcast together"
                ) from None
            if b.device != a.device:
                raise ValueError(f"y must be on x's device ({a.device}), got {b.device}")
            a, b = a.expand(shape), b.expand(shape)
        elif not isinstance(b, (int, float)) or isinstance(b, bool):
            raise TypeError(f"y must be a torch.Tensor or a number, got {type(b).__name__}")
        elif abs(b) >= 2**1024:  # an int that has no float64 value
            raise ValueError(
                f"y must be within the float64 range (magnitude below 2**1024), got an int of "
                f"{abs(b).bit_length()} bits"
            )
        if a.dtype != self.dtype and isinstance(b, torch.Tensor) and b.dtype == self.dtype:
            a, b = b, a  # addition commutes; the container is the operand of the adder's dtype
        if a.dtype != self.dtype:
            # Neither operand has the adder's dtype: add in a container that holds both operands
            # and the format, then convert (exactly: the result lies in the format). Both operands
            # move to it, so that add(a, b) and add(b, a) give sr_add the same pair of dtypes
            # (under randomness="value" the word is keyed by the operands as sr_add receives them).
            dtypes = (a.dtype, getattr(b, "dtype", None), self.dtype)
            container = torch.float64 if torch.float64 in dtypes else torch.float32
            a = a.to(container)
            if isinstance(b, torch.Tensor):
                b = b.to(container)
        if self.randomness == "value" and isinstance(b, torch.Tensor) and b.dtype == a.dtype:
            # sr_add keys a word by the ordered pair (a, b); putting the smaller value first makes
            # add(a, b) and add(b, a) draw the same word, as StochasTorch's symmetric hash does.
            # Pairs that do not compare (equal values, +0 and -0, NaN) keep their order: their
            # sums are exact or NaN, so no word is used. (torch.minimum would lose a zero's sign.)
            swap = a > b
            a, b = torch.where(swap, b, a), torch.where(swap, a, b)
        out = sr_add(
            a,
            b,
            self.format,
            rounding,
            seed=self.seed,
            offset=self.calls,
            randomness=self.randomness,
        )
        self.calls += 1  # a call that raised drew no words: the next one takes its offset
        return out.to(self.dtype)

    def add(self, x: torch.Tensor, y: torch.Tensor | float) -> torch.Tensor:
        """x + y rounded up or down with probability 1/2 each when inexact (biased in
        expectation). The result has the adder's dtype."""
        return self._add(x, y, "stochastic_equal")

    def add_biased(self, x: torch.Tensor, y: torch.Tensor | float) -> torch.Tensor:
        """x + y rounded up with probability proportional to its distance from the value below
        (unbiased in expectation: E[result] = x + y). The result has the adder's dtype."""
        return self._add(x, y, "stochastic")

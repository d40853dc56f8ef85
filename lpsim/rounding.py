"""The rounding rules.

Every rule acts on the magnitude and keeps the sign, so no rule changes a sign (except that formats
without -0 return +0). A value already in the format is returned unchanged by every rule,
stochastic ones included. See docs/rounding.md for a worked example of each.

=====================  ====================================================================
``nearest``            nearest value, ties to the even neighbour (IEEE 754 default)
``nearest_away``       nearest value, ties away from zero
``nearest_zero``       nearest value, ties toward zero
``toward_zero``        truncation
``away``               away from zero
``up``                 toward +Inf
``down``               toward -Inf
``odd``                an inexact value goes to the neighbour whose last digit is odd
``stochastic``         up with probability (x - below) / (above - below): unbiased ("mode 1")
``stochastic_equal``   an inexact value goes up or down with probability 1/2 ("mode 2")
=====================  ====================================================================

The stochastic rules take ``rbits`` (1 to 32, default 32): the decision uses the top ``rbits``
bits of a 32-bit random word against the discarded fraction truncated to ``rbits`` bits, so the
rule behaves as if x were first truncated to ``rbits`` bits below the format's last digit. With
the default, ``stochastic`` rounds up with probability floor(frac * 2**32) / 2**32 (exact whenever
the discarded part spans at most 32 bit positions) and ``stochastic_equal`` moves any inexact value.
"""

from __future__ import annotations

import enum

__all__ = ["Rounding", "MAX_RBITS"]

MAX_RBITS = 32  # bits of one random word


class Rounding(enum.IntEnum):
    """A rounding rule. The integer values are the codes the compiled kernels use."""

    nearest = 0
    nearest_away = 1
    nearest_zero = 2
    toward_zero = 3
    away = 4
    up = 5
    down = 6
    odd = 7
    stochastic = 8
    stochastic_equal = 9

    @property
    def is_stochastic(self) -> bool:
        """Whether the rule draws random words (and accepts ``rbits``)."""
        return self in _STOCHASTIC

    @classmethod
    def parse(cls, value: Rounding | str, name: str = "rounding") -> Rounding:
        """The rule named by ``value``: a Rounding, or its name as a string ("nearest", ...).
        ``name``: the argument's name in the messages.

        Raises:
            TypeError: ``value`` is neither a Rounding nor a string.
            ValueError: the string names no rule; the message lists the valid names.
        """
        if isinstance(value, Rounding):
            return value
        if isinstance(value, str):
            rule = _BY_NAME.get(value)  # a dict look-up: cls[value] costs ~1 us a call
            if rule is None:
                names = ", ".join(repr(r.name) for r in cls)
                raise ValueError(f"{name} must be one of {names}; got {value!r}")
            return rule
        raise TypeError(f"{name} must be a str or lpsim.Rounding, got {type(value).__name__}")


_BY_NAME = dict(Rounding.__members__)
_STOCHASTIC = (Rounding.stochastic, Rounding.stochastic_equal)  # read by is_stochastic


def check_rbits(rbits: int | None, rounding: Rounding) -> int:
    """The number of random bits to pass to the kernels (``MAX_RBITS`` when ``rbits`` is None).

    Raises:
        TypeError: ``rbits`` is not an int.
        ValueError: ``rbits`` is outside [1, 32], or given for a rule that is not stochastic.
    """
    if rbits is None:
        return MAX_RBITS
    if not isinstance(rbits, int) or isinstance(rbits, bool):
        raise TypeError(f"rbits must be an int or None, got {type(rbits).__name__}")
    if not rounding.is_stochastic:
        raise ValueError(f"rbits applies to the stochastic rules only, not to {rounding.name!r}")
    if not 1 <= rbits <= MAX_RBITS:
        raise ValueError(f"rbits must be in [1, {MAX_RBITS}], got {rbits}")
    return rbits

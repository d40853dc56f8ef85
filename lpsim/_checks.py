"""Argument checks and random-stream arguments shared by lpsim's modules.

Every public entry point validates its tensors, integers, seeds and offsets here, so that one kind
of mistake gets one message wherever it is made, and every function that draws random numbers
derives its seed the same way: from ``seed=`` when given, else from torch's default CPU generator
(``draw_seed``), so that ``torch.manual_seed`` makes runs reproducible.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch

from lpsim.formats import GRID_FORMATS
from lpsim.rounding import Rounding, check_rbits

CONTAINER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
RANDOMNESS = ("position", "value")  # the randomness codes 0 and 1 of the compiled update ops
MAX_SEED = 2**64  # seeds and offsets are 64-bit words: 0 <= seed, offset < MAX_SEED


def draw_seed(like: torch.Tensor | None = None) -> torch.Tensor:
    """A seed drawn from torch's default CPU generator: 63 random bits in a 0-d int64 tensor. The
    compiled ops draw the same value themselves when given no seed (csrc/checks.cpp).

    ``like``: the tensor the seed will round. While torch.compile traces, the draw is made from
    it (the same value), so that it happens where that tensor exists: a draw that depends on
    nothing is free to move, and AOTAutograd's partitioner moves one made in a backward pass
    (an error format's) into the forward graph when random ops are impure
    (torch._inductor.config.fallback_random = True), so that an injected model's draws came in
    another order than in eager mode (every seed after it changed)."""
    if like is not None and torch.compiler.is_compiling():
        anchor = like.new_zeros((), dtype=torch.int64, device="cpu")
        return torch.randint_like(anchor, 2**63 - 1)
    # randint(high, size) draws what randint(0, high, size, dtype=torch.int64) draws (int64 is
    # randint's default dtype), ~1 us sooner: fewer arguments to parse.
    return torch.randint(2**63 - 1, ())


def under_torch_func() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, jacfwd, hessian, ...) is active: whether
    functorch's interpreter stack holds one. Asked with isinstance, which dynamo answers while it
    traces, in a transform or not (it breaks the graph at maybe_current_level(), and it answers
    ``peek_interpreter_stack() is not None`` with True outside any transform)."""
    functorch = torch._C._functorch
    return isinstance(functorch.peek_interpreter_stack(), functorch.CInterpreter)


def functorch_transforms() -> list:
    """The kinds (torch._C._functorch.TransformType) of the torch.func transforms active now,
    outermost first; none outside them and while torch.compile traces."""
    if torch.compiler.is_compiling():
        return []
    return [interpreter.key() for interpreter in torch._C._functorch.get_interpreter_stack() or ()]


def under_vmap() -> bool:
    """Whether a torch.func.vmap transform is active (also around grad, jvp, ... inside it)."""
    return torch._C._functorch.TransformType.Vmap in functorch_transforms()


def signature_kept(function_class: type) -> type:
    """Class decorator for a torch.autograd.Function with setup_context: its forward keeps its
    signature, computed once (``__signature__``, which inspect.signature returns as it is).
    torch's apply binds the arguments of every call to forward's signature, and computing the
    signature anew took about 20 us a call, more than the rest of a quantiser on a small
    tensor."""
    function_class.forward.__signature__ = inspect.signature(function_class.forward)
    return function_class


def draws_seed_in_python() -> bool:
    """Whether a stochastic rule without a seed draws it here (draw_seed) rather than in the op:
    while torch.compile traces, so that the graph holds the draw as a random op of its own, and
    under torch.func's transforms, so that the draw is subject to vmap's ``randomness``: "error"
    (vmap's default) raises, "same" gives every sample the same seed, "different" a seed each."""
    return torch.compiler.is_compiling() or under_torch_func()


def seed_argument(
    seed: int | None, rounding: Rounding, like: torch.Tensor | None = None
) -> int | torch.Tensor | None:
    """The seed as the compiled ops take it (through lpsim._ops.call): the 64 seed bits as a
    signed int64 value, or None.

    None stands for "no random words" for rules that draw none (which then consume nothing from
    torch's generator, and ignore a seed given, once checked), and for "draw one" for a stochastic
    rule without a seed: the op draws it from torch's default CPU generator, as draw_seed() would,
    without a tensor per call. While torch.compile traces and under torch.func's transforms, the
    draw is draw_seed() here instead (draws_seed_in_python).

    Raises:
        TypeError: seed is not an int or None.
        ValueError: seed is outside [0, 2**64).
    """
    if seed is None:
        drawn = rounding.is_stochastic and draws_seed_in_python()
        return draw_seed(like) if drawn else None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not rounding.is_stochastic:
        return None
    return seed - MAX_SEED if seed >= 2**63 else seed


def check_offset(offset: int) -> int:
    """The stream offset as the compiled ops take it: the 64 bits of 0 <= offset < 2**64 as a
    signed int64 value.

    Raises:
        TypeError: offset is not an int.
        ValueError: offset is outside [0, 2**64).
    """
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if not 0 <= offset < MAX_SEED:
        raise ValueError(f"offset must be in [0, 2**64), got {offset}")
    return offset - MAX_SEED if offset >= 2**63 else offset


def random_args(
    rounding: Rounding | str,
    rbits: int | None,
    seed: int | None,
    offset: int,
    like: torch.Tensor | None = None,
) -> tuple[Rounding, int, int | torch.Tensor | None, int]:
    """(rule, rbits, seed, offset) checked, in the order the compiled ops take them (the seed as
    seed_argument gives it; ``like``: the tensor it rounds, see draw_seed).

    Raises:
        TypeError, ValueError: as Rounding.parse, check_rbits, seed_argument and check_offset.
    """
    rule = Rounding.parse(rounding)
    return rule, check_rbits(rbits, rule), seed_argument(seed, rule, like), check_offset(offset)


def check_tensor(x, name: str = "x") -> None:
    """Raises TypeError unless x is a torch.Tensor (the message calls it ``name``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_strided(x: torch.Tensor, name: str, function: str) -> None:
    """Raises TypeError unless x is a strided (dense) tensor: the compiled ops read storage, which
    sparse, nested and MKL-DNN tensors do not lay out as one strided array (the message names x as
    ``name`` and the caller as ``function``, and the way to the tensors it takes)."""
    if x.is_nested:  # a nested tensor may have torch.strided as its layout
        kind, way = "nested", "unbind() gives its tensors"
    elif x.layout != torch.strided:
        kind = str(x.layout).replace("torch.", "").lstrip("_")
        way = "a sparse tensor's values() is one" if "sparse" in kind else "to_dense() gives one"
    else:
        return
    raise TypeError(f"{name} is a {kind} tensor; {function} takes strided tensors ({way})")


def check_factor(name: str, value: float, dtype: torch.dtype, where: str) -> None:
    """Raises ValueError for a finite number ``value`` (the argument ``name``) beyond the range of
    ``dtype``, in which an op multiplies by it (``where`` says which): torch refuses a scalar that
    overflows its computation's dtype, and here it would become an infinite factor."""
    limit = torch.finfo(dtype).max
    if math.isfinite(value) and abs(value) > limit:
        kind = str(dtype).replace("torch.", "")
        raise ValueError(
            f"{name} must be within {kind}'s range (magnitude at most {limit!r}) {where}; "
            f"got {value!r}"
        )


def check_container(x, name: str = "x", allowed: Sequence[torch.dtype] = CONTAINER_DTYPES) -> None:
    """Raises TypeError unless x is a tensor of one of the ``allowed`` floating dtypes."""
    check_tensor(x, name)
    if x.dtype not in allowed:
        names = [str(d).replace("torch.", "") for d in allowed]
        names = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        raise TypeError(f"{name} must be a {names} tensor, got {x.dtype}")


def check_int(name: str, value, low: int, high: int) -> int:
    """value, checked to be an int (not a bool) in [low, high].

    Raises:
        TypeError: value is not an int.
        ValueError: value is outside [low, high].
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """value, checked to be a bool (as torch's argument parser checks one: not an int, not None).

    Raises:
        TypeError: value is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def as_float64(name: str, value: int | float) -> float:
    """A Python number (int or float) as a float64.

    Raises:
        ValueError: an int beyond the float64 range (the message calls it ``name``).
    """
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be within the float64 range (magnitude below 2**1024), got an int of "
            f"{abs(value).bit_length()} bits"
        ) from None


def check_number(name: str, value, low: float = 0.0, high: float = math.inf) -> float:
    """value, checked to be a real number (an int or float, not a bool) in [low, high] and, an
    int, within the float64 range (the optimizers compute with it as a float).

    Raises:
        TypeError: value is not a number.
        ValueError: value is outside [low, high] or, an int, beyond the float64 range.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    as_float64(name, value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_positive_finite(name: str, value) -> float:
    """value as a float, checked to be a finite number > 0 (an int or float, not a bool).

    Raises:
        ValueError: value is not such a number (inf, nan, 0, negative or not a number), or an
            int beyond the float64 range.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return as_float64(name, value)


def positive_finite_attribute(name: str, doc: str) -> property:
    """A property ``name`` whose value is checked by check_positive_finite on every assignment,
    the constructor's included (stored as ``_name``): a number assigned between steps is
    validated as the constructor's argument is, and applies from the next step."""
    private = "_" + name

    def setter(self, value) -> None:
        setattr(self, private, check_positive_finite(name, value))

    return property(lambda self: getattr(self, private), setter, doc=doc)


def check_betas(betas) -> tuple[float, float]:
    """Adam's (beta1, beta2), checked: a pair of numbers, each in [0, 1).

    Raises:
        TypeError: betas is not a pair of numbers.
        ValueError: a beta is outside [0, 1).
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        check_number(name, beta, 0.0, 1.0)
        if beta == 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    return tuple(betas)


def check_randomness(randomness: str) -> int:
    """The code of a randomness name ("position": 0, "value": 1).

    Raises:
        TypeError: randomness is not a str.
        ValueError: it is not one of RANDOMNESS.
    """
    if not isinstance(randomness, str):
        raise TypeError(f"randomness must be a str, got {type(randomness).__name__}")
    if randomness not in RANDOMNESS:
        raise ValueError(f"randomness must be one of {RANDOMNESS}, got {randomness!r}")
    return RANDOMNESS.index(randomness)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """value, checked to be one of ``choices``.

    Raises:
        ValueError: it is not (the message lists the choices).
    """
    if value not in choices:
        listed = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {listed}, got {value!r}")
    return value


def check_rule(rounding: Rounding | str, rules: Sequence[Rounding], where: str) -> Rounding:
    """The rule ``rounding`` names, checked to be one of ``rules`` (the rules ``where`` accepts).

    A name that is no lpsim rule at all (a typo) gets the same message as a rule outside
    ``rules``: it lists only the accepted rules, not all those Rounding.parse knows.

    Raises:
        TypeError: rounding is not a str or Rounding.
        ValueError: it names no rule of ``rules``.
    """
    if isinstance(rounding, str) and rounding not in Rounding.__members__:
        rule = None
    else:
        rule = Rounding.parse(rounding)  # raises TypeError for anything but a str or Rounding
    if rule not in rules:
        names = ", ".join(repr(r.name) for r in rules)
        got = rounding if rule is None else rule.name
        raise ValueError(f"rounding must be one of {names} for {where}; got {got!r}")
    return rule


def check_element_format(name: str, fmt) -> None:
    """Raises TypeError unless fmt is None, a Float, a Fixed or a P3109: a format whose grid
    around a value does not depend on other elements (a BlockFloat's does)."""
    if fmt is not None and not isinstance(fmt, GRID_FORMATS):
        raise TypeError(
            f"{name} must be a Float, Fixed or P3109 format or None, got {type(fmt).__name__}"
        )


def steps_in_backward(optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer an OptimLP wraps) is a torch.distributed
    ZeroRedundancyOptimizer made with ``overlap_with_ddp=True``: DistributedDataParallel's
    communication hook (ddp_zero_hook.hook_with_zero_step) steps it during the backward pass, as
    each gradient bucket is reduced, and its own step() does nothing. Nothing called after the
    backward pass (a rounding of the gradients, an unscaling, a skipped step) reaches its update."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415

    while optimizer is not None:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return bool(optimizer._overlap_with_ddp)  # no public accessor in torch
        optimizer = getattr(optimizer, "optimizer", None)  # OptimLP's wrapped optimizer
    return False

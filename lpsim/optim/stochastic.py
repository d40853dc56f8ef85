"""SGD and AdamW for weights stored in low precision, updated by stochastic rounding.

The weights themselves are the only copy: a bfloat16 tensor, or a float32 tensor restricted to any
Float (or Fixed) format. Each step computes the update u with torch.optim's own float32
operations (float64 for float64 parameters): the gradient, weight decay, momentum buffers and Adam
moments exactly as torch's single-tensor (foreach=False) SGD and AdamW compute them, and the term
torch adds to the weight (lr * d_p for SGD, step_size * m / denom for AdamW) as torch forms it:
SGD's alpha * d_p, which torch's ``add_(d_p, alpha=-lr)`` fuses into one rounding, is taken
exactly (in float64, where the product of two float32 values is exact; for float64 parameters it
is rounded to float64). The weight is then set to the exact sum w + u rounded once into the
weight format (lpsim.sr_add), so with ``rounding="nearest"`` and float32 weights in their own
format a step of SGD, or of AdamW without weight decay, is torch's bit for bit, except the sign of
a NaN the sum makes from Inf - Inf (an infinite weight and an update of the other sign): sr_add's
NaN is positive, torch's is the CPU's default NaN (negative on x86).

With round to nearest an update smaller than half a spacing of w is lost, and
training stagnates; with ``rounding="stochastic"`` it moves w to the next value with probability
|u| / spacing, so E[w_new] = w + u and the weights follow the float32 trajectory in expectation,
without the memory of a float32 master copy.

``kahan=True`` keeps instead a compensation buffer c in the weight format (the part of the updates
not applied yet) and runs Kahan's compensated summation in that format: y = u + c, w_new = w + y,
c = y - (w_new - w), each operation rounded to nearest, the second by ``rounding``. c and y are
signed, so the weight format must be too (an unsigned Fixed or P3109 format is refused). It costs
a second low-precision tensor per parameter (as much memory as a float32 master copy of a
bfloat16 weight) and is the usual deterministic alternative.

Optimizer states (momentum buffers, Adam moments) are float32 by default; ``state_format``
stores them in a low-precision format too, each new value computed in float32 and rounded once
into it by ``rounding``. The random words of step t of parameter number i come from the stream
offset (t << 32) + 4 i + k (k = 0 for the weight, 1 and 2 for the states; distinct for up to 2^30
parameters) under the optimizer's seed, so a run is reproducible from its seed and a resumed run
(load_state_dict) continues it. With ``randomness="value"`` the states' words are value-keyed as
the weights' are (by the new value and a zero of its sign), so the whole step is invariant under
any permutation or partition of a parameter's elements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lpsim._checks import (
    CONTAINER_DTYPES,
    RANDOMNESS,
    check_betas,
    check_bool,
    check_element_format,
    check_factor,
    check_number,
    draw_seed,
)
from lpsim.formats import Fixed, Float, check_fits
from lpsim.functional import quantize, quantize_
from lpsim.optim._own_options import OwnOptions
from lpsim.optim.fused import sgd_factors
from lpsim.rounding import Rounding, check_rbits
from lpsim.update import own_format, sr_add, sr_add_, sr_addcdiv_

__all__ = ["SGD", "AdamW"]

_WEIGHT, _FIRST_STATE, _SECOND_STATE = 0, 1, 2  # the k of a random stream's offset

# torch.optim options these optimizers do not implement: a parameter group may carry any key, so
# without a check a group asking for one of them would be stepped as if it had not.
_UNSUPPORTED = ("maximize", "amsgrad", "foreach", "fused", "capturable", "differentiable")


class _LowPrecision(OwnOptions):
    """What SGD and AdamW share: checking the options, rounding the parameters into their format
    when they join the optimizer, the rounded weight update and the rounded state updates."""

    def __init__(self, params, defaults: dict, seed: int | None, randomness: str):
        defaults = dict(defaults, seed=seed, randomness=randomness)
        self._check_options(defaults)  # draws the seed of the groups given here, if needed
        self._count = 0  # parameters seen so far: each one's number for its random streams
        super().__init__(params, defaults)
        # A group added later without a seed draws its own when it is added, as the first groups
        # drew theirs when they were made: a resumed optimizer, whose constructor drew another
        # seed than the interrupted one's, then adds the groups of the uninterrupted run.
        self.defaults["seed"] = seed

    def _check_options(self, group: dict) -> None:
        """The options of the optimizer, or of a parameter group (which may override any of them).

        Raises:
            TypeError / ValueError: an option has the wrong type or range (the message names it).
        """
        self._refuse_unsupported(group)
        check_element_format("weight_format", group["weight_format"])
        check_element_format("state_format", group["state_format"])
        rule = Rounding.parse(group["rounding"])
        check_rbits(group["rbits"], rule)
        if not isinstance(group["kahan"], bool):
            raise TypeError(f"kahan must be a bool, got {type(group['kahan']).__name__}")
        weight_format = group["weight_format"]
        if group["kahan"] and not getattr(weight_format, "signed", True):  # Fixed's and P3109's
            # y = u + c and c = y - (w_new - w) are negative as often as positive: an unsigned
            # format would send them to 0 (or NaN under SatNone), and the weights would never
            # decrease.
            raise ValueError(
                "kahan=True keeps the compensation, a signed quantity, in the weight format: "
                f"weight_format must be a signed format with kahan=True, got {weight_format!r}"
            )
        randomness = group["randomness"]
        if not isinstance(randomness, str) or randomness not in RANDOMNESS:
            raise ValueError(f"randomness must be one of {RANDOMNESS}, got {randomness!r}")
        if group["seed"] is None and rule.is_stochastic:
            group["seed"] = int(draw_seed())
        seed = group["seed"]
        if seed is not None and (
            not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64
        ):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")

    def _refuse_unsupported(self, group: dict) -> None:
        """Refuse a group asking for a torch.optim option these optimizers do not implement (set
        when the group was made, or later: a step checks again).

        Raises:
            ValueError: the option is set (the message names it).
        """
        for name in _UNSUPPORTED:
            if group.get(name) not in (None, False):
                raise ValueError(
                    f"{name} must be False or None: {type(self).__name__} does not implement "
                    f"torch.optim's {name}, got {group[name]!r}"
                )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_options(group)
            index = len(self.param_groups) - 1
            for i, p in enumerate(group["params"]):
                self._check_fits(group, p, f"parameter {i} of group {index}")
        except (TypeError, ValueError):
            self.param_groups.pop()  # a refused group is not kept, nor any parameter of it changed
            raise
        with torch.no_grad():
            for p in group["params"]:
                # The weights must be values of their format.
                quantize_(p, self._weight_format(group, p), "nearest")
                self.state[p]["index"] = self._count
                self._count += 1

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer.load_state_dict, except that state tensors keep their dtypes
        (torch casts floating-point state to the parameter's dtype, which would round float32
        moments of bfloat16 weights to bfloat16).

        It also takes a state_dict of the torch optimizer of the same name (torch.optim.SGD's or
        AdamW's), to continue its run: the options and formats its groups lack take this
        optimizer's constructor values (a group with a stochastic rule and no seed draws its own,
        as a group added later does), its parameters are numbered in parameter order for their
        random streams, and its step counts become the ints this optimizer keeps. The loaded
        groups are checked as add_param_group checks a group. Saved stream numbers that repeat (a
        ZeroRedundancyOptimizer's consolidated state_dict, whose ranks numbered their shards from
        0 each) are replaced likewise, so that no two parameters share their random words.

        Raises:
            TypeError / ValueError: a loaded group's option is refused (the message names it); the
                optimizer then keeps its state.
        """
        kept = self.state_dict()
        self._load(state_dict)
        try:
            for group in self.param_groups:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                self._check_options(group)
        except (TypeError, ValueError):
            self._load(kept)
            raise
        self._number_states()

    def _number_states(self) -> None:
        """Give the parameters' states distinct stream numbers and int step counts, where a
        state was put in place without them: loaded from the torch optimizer's state_dict (no
        numbers; AdamW's step count a tensor), set by ZeroRedundancyOptimizer.load_state_dict
        (which sets each parameter's state of its local optimizer itself, without this
        optimizer's load_state_dict), or loaded from a ZeroRedundancyOptimizer's consolidated
        state_dict (each rank numbered its shard from 0, so the numbers repeat). Numbers that are
        all there and distinct are kept, so that a resumed run continues its streams; otherwise
        every parameter is numbered in parameter order, as load_state_dict numbers those of a
        torch optimizer's state_dict (two parameters with one number would round with the same
        random words at every step)."""
        params = [p for group in self.param_groups for p in group["params"]]
        states = [self.state[p] for p in params]
        numbers = [state.get("index") for state in states]
        if None in numbers or len(set(numbers)) < len(numbers):
            numbers = list(range(len(states)))
            for number, state in zip(numbers, states):
                state["index"] = number
        self._count = max([self._count - 1, *numbers]) + 1  # a group added later: a new number
        for state in states:
            if isinstance(state.get("step"), torch.Tensor):  # torch's AdamW counts in a tensor
                state["step"] = int(state["step"].item())

    def _load(self, state_dict: dict) -> None:
        """torch's load_state_dict, the state tensors in their saved dtypes."""
        saved = {
            index: {
                key: value.clone()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            }
            for index, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, tensors in saved.items():
            p = params[index]
            for key, value in tensors.items():
                self.state[p][key] = value.to(p.device)

    def _check_fits(self, group: dict, p: torch.Tensor, where: str) -> None:
        """Parameter p of ``group`` (``where`` says which) has a supported dtype, which its
        weight format fits, and float64 fits the group's state format: checked when the group
        joins and again at every step, where the formats may have been set on the group since.

        Raises:
            TypeError: the parameter's dtype is not supported.
            ValueError: a format does not fit (the message names it and the parameter).
        """
        if p.dtype not in CONTAINER_DTYPES:
            raise TypeError(
                f"parameters must be float32, float64, bfloat16 or float16 tensors, got {p.dtype}"
            )
        for name, fmt, dtype in (
            ("weight_format", self._weight_format(group, p), p.dtype),
            ("state_format", group["state_format"], torch.float64),
        ):
            if fmt is None:
                continue
            try:
                check_fits(fmt, dtype)
            except ValueError as error:
                raise ValueError(f"{name} ({where}): {error}") from None

    @staticmethod
    def _weight_format(group: dict, p: torch.Tensor) -> Float | Fixed:
        return group["weight_format"] if group["weight_format"] is not None else own_format(p.dtype)

    @staticmethod
    def _work_dtype(p: torch.Tensor) -> torch.dtype:
        """The precision updates are computed in."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    @staticmethod
    def _offset(state: dict, kind: int) -> int:
        return (state["step"] << 32) + 4 * state["index"] + kind

    def _random(self, group: dict, state: dict, kind: int) -> dict:
        if group["seed"] is None and Rounding.parse(group["rounding"]).is_stochastic:
            # A group made with a deterministic rule, whose rule was changed since: its seed is
            # drawn once, as the constructor draws it, and kept (and saved) with the group.
            group["seed"] = int(draw_seed())
        return dict(rbits=group["rbits"], seed=group["seed"], offset=self._offset(state, kind))

    def _store(
        self, group: dict, state: dict, key: str, value: torch.Tensor, kind: int, like: torch.Tensor
    ) -> torch.Tensor:
        """Keep ``value`` (work precision) as state[key], rounded into state_format if given, in
        the first of the parameter's dtype, float32 and float64 that holds that format.
        Returns the stored value in the work precision, the precision in which the update is
        computed from it with torch's operations (and in which the next step reads it), whatever
        dtype holds the state. A format only float64 holds is rounded in float64, where the
        value is exact; the rounded value converts back exactly, unless it rounded up past
        float32's largest value (Inf in float32, as float32 arithmetic would have it)."""
        fmt = group["state_format"]
        if fmt is None:
            state[key] = value
            return value
        for dtype in (like.dtype, torch.float32, torch.float64):
            try:
                check_fits(fmt, dtype)
                break
            except ValueError:
                continue
        work = value.dtype
        if dtype == torch.float64:  # a format only float64 holds: round in it (value is exact)
            value = value.to(dtype)
        random = self._random(group, state, kind)
        if group["randomness"] == "value":
            # Value-keyed words, as for the weights: quantize draws position-keyed ones, so the
            # state is rounded as the exact sum of a zero (of value's sign) and value, which is
            # value rounded once.
            zero = torch.zeros_like(value).copysign_(value)
            stored = sr_add(zero, value, fmt, group["rounding"], randomness="value", **random)
        else:
            stored = quantize(value, fmt, group["rounding"], **random)
        state[key] = stored.to(dtype)
        return stored.to(work)

    def _update(self, group: dict, p: torch.Tensor, state: dict, update: torch.Tensor) -> None:
        """p = p + update rounded into the weight format (with Kahan compensation if asked)."""
        fmt = self._weight_format(group, p)
        random = self._random(group, state, _WEIGHT)
        if not group["kahan"]:
            sr_add_(p, update, fmt, group["rounding"], randomness=group["randomness"], **random)
            return
        if "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        c = state["compensation"]
        y = sr_add(c, update, fmt, "nearest")
        new = sr_add(p, y, fmt, group["rounding"], randomness=group["randomness"], **random)
        gained = sr_add(new, p.neg(), fmt, "nearest")
        c.copy_(sr_add(y, gained.neg(), fmt, "nearest"))
        p.copy_(new)

    def _factors(self, group: dict, state: dict) -> list[tuple[str, float]]:
        """The numbers that the step of a parameter with this state (before the step) converts
        to its work precision as a factor, named: torch's optimizers refuse one beyond that
        precision's range (``value cannot be converted to type float without overflow``), where
        it would become an infinite factor."""
        return [("lr", group["lr"])]

    def _steps(self, closure):
        """Evaluate the closure; then (group, p, state, grad in work precision) for every
        parameter with a gradient, its step count advanced."""
        for group in self.param_groups:
            # torch's optimizers read a group's options at every step: one set since the group
            # was made (kahan="no", say, which is truthy) is checked as the constructor checks it.
            self._check_options(group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []  # (group, where, p) for every parameter with a gradient
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    stepped.append((group, f"parameter {i} of group {g}", p))
        for group, where, p in stepped:  # every refusal before any state changes
            # A format set on the group since it was made must fit too.
            self._check_fits(group, p, where)
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            why = "for parameters of that work precision, as torch's optimizers require"
            for name, value in self._factors(group, self.state.get(p, {})):
                check_factor(name, value, self._work_dtype(p), why)
        self._number_states()
        work = []
        for group, _, p in stepped:
            state = self.state[p]
            state["step"] = state.get("step", 0) + 1
            work.append((group, p, state, p.grad.to(self._work_dtype(p), copy=True)))
        return loss, work


def _scaled(t: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * t as torch's ``w.add_(t, alpha=alpha)`` adds it (one rounding of the whole sum):
    alpha rounded to t's dtype, the product exact in float64 for a float32 t (and rounded to
    float64 for a float64 t), ready for the exact sum of sr_add."""
    factor = torch.tensor(alpha, dtype=t.dtype).item()
    return t.to(torch.float64, copy=True).mul_(factor)


class SGD(_LowPrecision):
    """Stochastic gradient descent (momentum, Nesterov, weight decay; torch.optim.SGD's rules) on
    weights stored in low precision and updated by rounding the exact sum w + u once.

    Args:
        params: parameters (float32, float64, bfloat16 or float16 tensors) or parameter groups.
            They are rounded into their weight format (to nearest) when they join the optimizer.
        lr, momentum, dampening, weight_decay, nesterov: as in torch.optim.SGD (all >= 0;
            nesterov needs momentum > 0 and dampening = 0).
        weight_format: a Float, Fixed or P3109 format (a signed one with kahan) that fits the
            parameters' dtype; None: the dtype's own format (bfloat16 parameters hold bfloat16
            values).
        rounding: the rule of the weight and state updates, default "stochastic" (unbiased);
            "nearest" is ordinary low-precision training, which stagnates.
        rbits: random bits per stochastic decision (1 to 32).
        state_format: None (float32 momentum buffers) or a Float, Fixed or P3109 format to store
            them in.
        kahan: Kahan-compensated updates (see the module documentation).
        seed: 0 <= seed < 2**64; None: drawn from torch's default CPU generator when the rule
            is stochastic, once for the groups given here and once for each group added later
            without a seed, when it is added (a group with a deterministic rule draws nothing, so
            that the optimizer, as torch's own, leaves the generator to dropout and data order;
            its seed stays None until a stochastic rule first needs one). The streams are keyed by
            the seed and the step count: a new optimizer made with the same seed, its state not
            loaded, counts its steps from 1 again and repeats the first one's random words;
            resume with load_state_dict, or give it another seed.
        randomness: "position" or "value" (see lpsim.sr_add).

    Raises:
        TypeError / ValueError: an option has the wrong type or range, a parameter's dtype is not
            supported, or a format does not fit it.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        weight_format: Float | Fixed | None = None,
        rounding: Rounding | str = "stochastic",
        rbits: int | None = None,
        state_format: Float | Fixed | None = None,
        kahan: bool = False,
        seed: int | None = None,
        randomness: str = "position",
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            weight_format=weight_format,
            rounding=rounding,
            rbits=rbits,
            state_format=state_format,
            kahan=kahan,
        )
        super().__init__(params, defaults, seed, randomness)

    def _check_options(self, group: dict) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_number(name, group[name])
        check_bool("nesterov", group["nesterov"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        super()._check_options(group)

    def _factors(self, group: dict, state: dict) -> list[tuple[str, float]]:
        """weight_decay (where nonzero), 1 - dampening (momentum onto an existing buffer),
        momentum (Nesterov's) and lr: the alpha of torch.optim.SGD's in-place adds, as the fused
        step checks them."""
        return sgd_factors(group, state)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient. Returns the closure's loss."""
        loss, work = self._steps(closure)
        for group, p, state, d_p in work:
            if group["weight_decay"] != 0:
                d_p.add_(p.to(d_p.dtype), alpha=group["weight_decay"])
            momentum = group["momentum"]
            if momentum != 0:
                buf = state.get("momentum_buffer")
                new = (
                    d_p.clone()
                    if buf is None
                    else buf.to(d_p.dtype).mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
                )
                buf = self._store(group, state, "momentum_buffer", new, _FIRST_STATE, p)
                d_p = d_p.add_(buf, alpha=momentum) if group["nesterov"] else buf
            self._update(group, p, state, _scaled(d_p, -group["lr"]))
        return loss


class AdamW(_LowPrecision):
    """Adam with decoupled weight decay (torch.optim.AdamW's rules) on weights stored in low
    precision. The step w - lr wd w - lr m_hat / (sqrt(v_hat) + eps) is one rounding of the exact
    sum of w and that update; without weight decay and Kahan compensation it is computed by the
    fused lpsim.sr_addcdiv_.

    Args:
        params, weight_format, rounding, rbits, state_format, kahan, seed, randomness: as for SGD
            (state_format applies to both moments).
        lr, betas, eps, weight_decay: as in torch.optim.AdamW (lr, eps, weight_decay >= 0;
            0 <= beta < 1).

    Raises:
        TypeError / ValueError: as for SGD.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        weight_format: Float | Fixed | None = None,
        rounding: Rounding | str = "stochastic",
        rbits: int | None = None,
        state_format: Float | Fixed | None = None,
        kahan: bool = False,
        seed: int | None = None,
        randomness: str = "position",
    ):
        check_betas(betas)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            weight_format=weight_format,
            rounding=rounding,
            rbits=rbits,
            state_format=state_format,
            kahan=kahan,
        )
        super().__init__(params, defaults, seed, randomness)

    def _check_options(self, group: dict) -> None:
        # torch's AdamW takes a tensor lr (a scheduler may set one after the group was made),
        # which makes its step size float32; this one's is float64 and takes a number.
        for name in ("lr", "eps", "weight_decay"):
            check_number(name, group[name])
        group["betas"] = check_betas(group["betas"])
        # torch.optim.Adam's groups (a loaded state_dict's) say decoupled_weight_decay=False: an
        # L2 term in the gradient, which this AdamW does not implement.
        if group.get("decoupled_weight_decay", True) is not True:
            raise ValueError(
                f"decoupled_weight_decay must be True: {type(self).__name__} decouples its weight "
                f"decay, got {group['decoupled_weight_decay']!r}"
            )
        super()._check_options(group)

    def _factors(self, group: dict, state: dict) -> list[tuple[str, float]]:
        """lr and the step size lr / (1 - beta1^step) of the step about to be taken: the value of
        torch.optim.AdamW's addcdiv_."""
        step = state.get("step", 0) + 1
        size = group["lr"] / (1 - group["betas"][0] ** step)
        return [
            ("lr", group["lr"]),
            (f"lr / (1 - betas[0]**step), the step size of step {step},", size),
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient. Returns the closure's loss."""
        loss, work = self._steps(closure)
        for group, p, state, grad in work:
            beta1, beta2 = group["betas"]
            t = state["step"]
            # torch's arithmetic: the moments start at zero and take lerp_ and mul_/addcmul_.
            m, v = state.get("exp_avg"), state.get("exp_avg_sq")
            m = torch.zeros_like(grad) if m is None else m.to(grad.dtype)
            v = torch.zeros_like(grad) if v is None else v.to(grad.dtype)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m = self._store(group, state, "exp_avg", m, _FIRST_STATE, p)
            v = self._store(group, state, "exp_avg_sq", v, _SECOND_STATE, p)
            step_size = group["lr"] / (1 - beta1**t)
            # torch's bias_correction2 ** 0.5 (a pow, which is not math.sqrt in every last bit).
            denom = v.sqrt().div_((1 - beta2**t) ** 0.5).add_(group["eps"])
            decay = group["lr"] * group["weight_decay"]
            if decay == 0 and not group["kahan"]:
                # The term (value * m) / denom, as torch's addcdiv_ forms it.
                sr_addcdiv_(
                    p,
                    m,
                    denom,
                    -step_size,
                    self._weight_format(group, p),
                    group["rounding"],
                    randomness=group["randomness"],
                    **self._random(group, state, _WEIGHT),
                )
                continue
            update = torch.addcdiv(p.to(grad.dtype) * -decay, m, denom, value=-step_size)
            self._update(group, p, state, update)
        return loss

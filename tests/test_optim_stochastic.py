"""lpsim.optim.SGD and AdamW: low-precision weights updated by stochastic rounding reach the
float32 optimum of a convex problem, nearest rounding stalls, and the rules follow torch.optim."""

from __future__ import annotations

import re

import pytest
import torch
from gfloat import RoundMode, round_float
from gfloat.formats import format_info_p3109
from gfloat.types import Domain, Signedness
from support import assert_same_bits

import lpsim
from lpsim import Fixed, Float

# Least squares with a unique optimum w_star of entries in [1, 2), where a bfloat16 spacing is
# 2**-7: gradient steps lr * grad fall below half a spacing long before w reaches w_star.
torch.manual_seed(0)
X = torch.randn(256, 8)
W_STAR = torch.rand(8) + 1.0
Y = X @ W_STAR
STEPS = 1500
LR = 3e-3


def _loss(w: torch.Tensor) -> torch.Tensor:
    return ((X @ w.float() - Y) ** 2).mean()


def _train(make_optimizer, dtype=torch.bfloat16, steps=STEPS) -> torch.Tensor:
    w = torch.zeros(8, dtype=dtype, requires_grad=True)
    opt = make_optimizer([w])
    for _ in range(steps):
        opt.zero_grad()
        _loss(w).backward()
        opt.step()
    return w.detach()


def _distance(w: torch.Tensor) -> float:
    return (w.float() - W_STAR).norm().item()


def test_sr_sgd_with_bfloat16_weights_reaches_the_float32_optimum_where_nearest_stalls():
    float32 = _distance(_train(lambda p: torch.optim.SGD(p, lr=LR), torch.float32))
    nearest = _distance(_train(lambda p: lpsim.optim.SGD(p, lr=LR, rounding="nearest")))
    stochastic = _distance(_train(lambda p: lpsim.optim.SGD(p, lr=LR, seed=0)))
    kahan = _distance(_train(lambda p: lpsim.optim.SGD(p, lr=LR, rounding="nearest", kahan=True)))
    # Tolerance: float32's own distance plus a few bfloat16 spacings (2**-7) per coordinate.
    tolerance = float32 + 4 * 2**-7 * 8**0.5
    assert float32 < 0.01
    assert stochastic < tolerance
    assert kahan < tolerance
    assert nearest > 10 * tolerance


def _kahan_model(w: float, update: float, steps: int, fmt) -> float:
    """Kahan's summation of `steps` equal updates into w, every operation rounded to nearest into
    fmt by gfloat (the P3109 working group's reference code)."""
    info = format_info_p3109(fmt.bits, fmt.precision, Signedness.Signed, Domain.Extended)

    def rnd(v: float) -> float:
        return round_float(info, v, RoundMode.TiesToEven, True)

    c = 0.0
    for _ in range(steps):
        y = rnd(update + c)
        new = rnd(w + y)
        c = rnd(y - rnd(new - w))
        w = new
    return w


@pytest.mark.parametrize("saturation", lpsim.formats.P3109_SATURATIONS)
def test_kahan_compensation_needs_a_signed_weight_format(saturation):
    """The compensation c and the corrected update y = u + c take both signs: in a signed P3109
    weight format Kahan's sum descends as gfloat's model of it does, and an unsigned one, which
    would clip every negative y and c to 0 (or make them NaN under SatNone), is refused."""
    signed = lpsim.P3109(8, 4, saturation=saturation)
    w = torch.full((4,), 4.0, requires_grad=True)
    opt = lpsim.optim.SGD([w], lr=0.125, weight_format=signed, rounding="nearest", kahan=True)
    for _ in range(10):
        w.grad = torch.ones(4)
        opt.step()
    assert w.tolist() == [_kahan_model(4.0, -0.125, 10, signed)] * 4 == [4.0 - 10 * 0.125] * 4
    for unsigned in (
        lpsim.P3109(8, 4, signed=False, saturation=saturation),
        Fixed(8, 4, signed=False),
    ):
        with pytest.raises(ValueError, match="weight_format must be a signed format with kahan"):
            lpsim.optim.SGD([w], weight_format=unsigned, kahan=True)
        opt = lpsim.optim.AdamW([w], weight_format=signed, kahan=True)
        with pytest.raises(ValueError, match="weight_format must be a signed format with kahan"):
            opt.add_param_group({"params": [torch.ones(2)], "weight_format": unsigned})
        lpsim.optim.SGD([torch.ones(2)], weight_format=unsigned)  # without kahan it is a format


def test_sr_adamw_with_bfloat16_weights_matches_float32_adamw_where_nearest_stalls():
    float32 = _distance(
        _train(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0), torch.float32)
    )
    nearest = _distance(
        _train(lambda p: lpsim.optim.AdamW(p, lr=LR, weight_decay=0, rounding="nearest"))
    )
    stochastic = _distance(_train(lambda p: lpsim.optim.AdamW(p, lr=LR, weight_decay=0, seed=0)))
    low_states = _distance(
        _train(
            lambda p: lpsim.optim.AdamW(p, lr=LR, weight_decay=0, seed=0, state_format=Float(8, 7))
        )
    )
    tolerance = float32 + 4 * 2**-7 * 8**0.5
    assert stochastic < tolerance
    assert low_states < tolerance
    assert nearest > 10 * tolerance


def test_float32_weights_restricted_to_a_format_hold_only_its_values():
    fmt = Float(5, 6)
    w = torch.randn(100, requires_grad=True)
    opt = lpsim.optim.SGD([w], lr=0.01, momentum=0.9, weight_format=fmt, seed=1)
    assert_same_bits(w.detach(), lpsim.quantize(w.detach(), fmt), "rounded when added")
    for _ in range(5):
        w.grad = torch.randn(100)
        opt.step()
        assert_same_bits(w.detach(), lpsim.quantize(w.detach(), fmt), "after a step")


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=0.9),
        dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
        dict(momentum=0.5, dampening=0.3, weight_decay=1e-3),
        dict(weight_decay=0.1),
    ],
)
def test_sgd_follows_torch_sgd_when_nothing_is_rounded_away(options):
    # float64 weights and states in float64 formats: rounding is far below the comparison's
    # tolerance.
    torch.manual_seed(2)
    w0 = torch.randn(50, dtype=torch.float64)
    grads = [torch.randn(50, dtype=torch.float64) for _ in range(6)]
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_ours = lpsim.optim.SGD([ours], lr=0.1, rounding="nearest", **options)
    opt_theirs = torch.optim.SGD([theirs], lr=0.1, **options)
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_follows_torch_adamw_when_nothing_is_rounded_away(weight_decay):
    torch.manual_seed(3)
    w0 = torch.randn(50, dtype=torch.float64)
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_ours = lpsim.optim.AdamW([ours], lr=0.01, weight_decay=weight_decay, rounding="nearest")
    opt_theirs = torch.optim.AdamW([theirs], lr=0.01, weight_decay=weight_decay)
    for _ in range(6):
        g = torch.randn(50, dtype=torch.float64)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_low_precision_states_are_stored_in_their_format():
    w = torch.zeros(6, dtype=torch.bfloat16, requires_grad=True)
    opt = lpsim.optim.AdamW([w], lr=LR, seed=0, state_format=Float(8, 7))
    w.grad = torch.linspace(0.1, 0.6, 6).bfloat16()
    opt.step()
    opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt.state[w][key]
        assert state.dtype == torch.bfloat16
    v = torch.zeros(6, requires_grad=True)
    sgd = lpsim.optim.SGD([v], lr=0.1, momentum=0.9, seed=0, state_format=Float(4, 3))
    v.grad = torch.linspace(0.1, 0.6, 6)
    sgd.step()
    sgd.step()
    buf = sgd.state[v]["momentum_buffer"]
    assert buf.dtype == torch.float32
    assert_same_bits(buf, lpsim.quantize(buf, Float(4, 3)), "momentum in e4m3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_state_format_only_float64_holds_is_rounded_and_stored_in_float64(dtype):
    # Float(11, 10) has float64's exponent range: the optimizer accepts it for the states of
    # float32 and bfloat16 weights, and must round and keep them in float64.
    fmt = Float(11, 10)
    grad = torch.tensor([1e-3, -0.7, 3.3, 1e-30, 0.0, 5e-41])
    w = torch.zeros(6, dtype=dtype, requires_grad=True)
    sgd = lpsim.optim.SGD([w], lr=0.5, momentum=0.9, state_format=fmt, rounding="nearest")
    w.grad = grad.to(dtype)
    sgd.step()
    buf = sgd.state[w]["momentum_buffer"]
    want = lpsim.quantize(grad.to(dtype).double(), fmt, "nearest")
    assert buf.dtype == torch.float64
    assert torch.equal(buf, want)
    assert torch.equal(
        w.detach(), lpsim.sr_add(torch.zeros(6, dtype=dtype), want * -0.5, None, "nearest")
    )
    v = torch.zeros(6, dtype=dtype, requires_grad=True)
    adam = lpsim.optim.AdamW([v], lr=1e-3, state_format=fmt, rounding="nearest")
    v.grad = grad.to(dtype)
    adam.step()
    m = adam.state[v]["exp_avg"]
    assert m.dtype == torch.float64
    assert torch.equal(m, lpsim.quantize((grad.to(dtype).float() * (1 - 0.9)).double(), fmt))


def test_same_seed_gives_the_same_run_and_state_dict_resumes_it():
    def run(steps, resume_from=None):
        w = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
        opt = lpsim.optim.SGD([w], lr=LR, momentum=0.9, seed=123)
        if resume_from is not None:
            w.data.copy_(resume_from[0])
            opt.load_state_dict(resume_from[1])
        for _ in range(steps):
            opt.zero_grad()
            _loss(w).backward()
            opt.step()
        return w.detach().clone(), opt.state_dict()

    full, _ = run(40)
    assert_same_bits(run(40)[0], full, "same seed")
    half = run(20)
    resumed, _ = run(20, resume_from=half)
    assert_same_bits(resumed, full, "resumed from a state_dict")
    other = lpsim.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR, seed=124)
    assert other.param_groups[0]["seed"] == 124


def test_value_keyed_optimizer_updates_are_reproducible():
    a = _train(lambda p: lpsim.optim.SGD(p, lr=LR, seed=5, randomness="value"), steps=50)
    b = _train(lambda p: lpsim.optim.SGD(p, lr=LR, seed=5, randomness="value"), steps=50)
    assert_same_bits(a, b)


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda w: lpsim.optim.SGD([w], lr=-1.0), ValueError, "lr must be in [0.0, inf]"),
        (lambda w: lpsim.optim.SGD([w], nesterov=True), ValueError, "nesterov needs momentum > 0"),
        (
            lambda w: lpsim.optim.SGD([w], weight_format=lpsim.BlockFloat(8)),
            TypeError,
            "weight_format must be a Float, Fixed or P3109",
        ),
        (
            lambda w: lpsim.optim.SGD([w], weight_format=Float(8, 10)),
            ValueError,
            "does not fit a bfloat16",
        ),
        (lambda w: lpsim.optim.SGD([w.int()]), TypeError, "parameters must be float32"),
        (lambda w: lpsim.optim.SGD([w], rounding="nearest", rbits=3), ValueError, "rbits applies"),
        (
            lambda w: lpsim.optim.SGD([w], randomness="hash"),
            ValueError,
            "randomness must be one of",
        ),
        (lambda w: lpsim.optim.SGD([w], seed=-2), ValueError, "seed must be an int in [0, 2**64)"),
        (
            lambda w: lpsim.optim.AdamW([w], betas=(0.9, 1.0)),
            ValueError,
            "betas[1] must be in [0, 1), got 1.0",
        ),
        (lambda w: lpsim.optim.AdamW([w], kahan=1), TypeError, "kahan must be a bool"),
        (
            lambda w: lpsim.optim.AdamW(
                [w], state_format=Fixed(8, 4, clamp=False), weight_format=3
            ),
            TypeError,
            "weight_format must be a Float, Fixed or P3109",
        ),
    ],
)
def test_bad_options_raise_errors_that_name_them(call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call(torch.zeros(3, dtype=torch.bfloat16, requires_grad=True))


@pytest.mark.parametrize(
    "option,value,error,words",
    [
        ("rounding", "nearst", ValueError, "rounding must be one of"),
        ("rbits", 99, ValueError, "rbits must be in [1, 32], got 99"),
        ("kahan", "yes", TypeError, "kahan must be a bool"),
        ("seed", -5, ValueError, "seed must be an int in [0, 2**64)"),
        ("randomness", "hash", ValueError, "randomness must be one of"),
        ("lr", -0.1, ValueError, "lr must be in"),
        ("state_format", "e4m3", TypeError, "state_format must be a Float, Fixed or P3109"),
    ],
)
@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_bad_options_of_a_parameter_group_raise_errors_that_name_them(
    optimizer, option, value, error, words
):
    w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(error, match=re.escape(words)):
        optimizer([{"params": [w], option: value}], seed=0)
    opt = optimizer([torch.zeros(2, requires_grad=True)], seed=0)
    with pytest.raises(error, match=re.escape(words)):
        opt.add_param_group({"params": [w], option: value})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_a_group_refused_for_one_parameter_is_not_kept_and_changes_no_parameter(optimizer):
    """The second parameter is float16, which Float(8, 9) does not fit: the group is refused and
    the first parameter, which it fits, is neither rounded into it nor numbered."""
    opt = optimizer([torch.zeros(2, requires_grad=True)], seed=0)
    fits = torch.tensor([0.1, 1 / 3], requires_grad=True)
    before = fits.detach().clone()
    unfit = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="does not fit a float16 tensor"):
        opt.add_param_group({"params": [fits, unfit], "weight_format": Float(8, 9)})
    assert len(opt.param_groups) == 1
    assert_same_bits(fits.detach(), before)
    fresh = torch.zeros(2, requires_grad=True)
    opt.add_param_group({"params": [fresh]})
    assert opt.state[fresh]["index"] == 1  # numbered as if the refused group had not been offered


def test_a_parameter_group_may_override_the_seed_and_the_rounding():
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    v = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    opt = lpsim.optim.SGD(
        [{"params": [w]}, {"params": [v], "seed": 5, "rounding": "nearest"}], lr=1.0, seed=3
    )
    w.grad = v.grad = torch.full((4,), -1e-3, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(v.detach(), torch.ones(4, dtype=torch.bfloat16))  # nearest: lost
    update = -w.grad.float()  # lr 1: the step is -grad, computed in float32
    want = lpsim.sr_add(torch.ones(4, dtype=torch.bfloat16), update, seed=3, offset=1 << 32)
    assert torch.equal(w.detach(), want)


@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_value_keyed_steps_with_low_precision_states_are_invariant_under_permutation(optimizer):
    # The states are rounded stochastically into e5m2 with value-keyed words too: permuting the
    # elements of the weight and of every gradient permutes the weights after three steps.
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(1000, generator=g).bfloat16()
    grads = [torch.randn(1000, generator=g).bfloat16() for _ in range(3)]
    perm = torch.randperm(1000, generator=g)
    options = {"lr": 0.1, "momentum": 0.9} if optimizer is lpsim.optim.SGD else {"lr": 0.01}

    def run(order):
        w = w0[order].clone().requires_grad_()
        opt = optimizer([w], seed=3, randomness="value", state_format=Float(5, 2), **options)
        for grad in grads:
            w.grad = grad[order].clone()
            opt.step()
        return w.detach()

    assert torch.equal(run(torch.arange(1000))[perm], run(perm))


def _steps_of_both(make_ours, make_theirs, steps=4, n=4000):
    """Weights and states of lpsim's and torch's optimizer after the same float32 gradients (of
    magnitudes 1e-4 to 1, so that updates and weights overlap in bits)."""
    torch.manual_seed(5)
    w0 = torch.randn(n)
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_ours, opt_theirs = make_ours([ours]), make_theirs([theirs])
    for _ in range(steps):
        g = torch.randn(n) * 10.0 ** torch.randint(-4, 1, (n,)).float()
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    return (ours, opt_ours.state[ours]), (theirs, opt_theirs.state[theirs])


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(momentum=0.9),
        dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
        dict(momentum=0.5, dampening=0.3, weight_decay=1e-3),
    ],
)
def test_sgd_with_nearest_on_float32_weights_is_torch_sgd_bit_for_bit(options):
    # torch's p.add_(d_p, alpha=-lr) rounds p - lr * d_p once: the update must be that product,
    # not its float32 rounding.
    (ours, state), (theirs, their_state) = _steps_of_both(
        lambda p: lpsim.optim.SGD(p, lr=0.1, rounding="nearest", **options),
        lambda p: torch.optim.SGD(p, lr=0.1, foreach=False, **options),
    )
    assert_same_bits(ours.detach(), theirs.detach())
    if "momentum" in options:
        assert_same_bits(state["momentum_buffer"], their_state["momentum_buffer"])


@pytest.mark.parametrize(
    "options, make_theirs",
    [
        (
            dict(momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        ),
        (
            dict(momentum=0.9, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
        ),
        (
            dict(weight_decay=0.0),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0, foreach=False),
        ),
    ],
    ids=["SGD", "SGD-nesterov", "AdamW"],
)
def test_states_kept_in_float64_are_used_in_float32_as_torch_uses_its_states(options, make_theirs):
    # Float(11, 23) holds every float32 value (so it rounds no state) and only float64 holds it:
    # the states are kept in float64, and the update must still be torch's float32 computation
    # (lr rounded to float32 and the term's operations in float32), as with float32 states.
    optimizer = lpsim.optim.AdamW if "weight_decay" in options else lpsim.optim.SGD
    lr = 0.01 if optimizer is lpsim.optim.AdamW else 0.1
    (ours, state), (theirs, their_state) = _steps_of_both(
        lambda p: optimizer(p, lr=lr, rounding="nearest", state_format=Float(11, 23), **options),
        make_theirs,
    )
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == torch.float64
            assert_same_bits(value.float(), their_state[key], key)
    assert_same_bits(ours.detach(), theirs.detach())


def test_adamw_with_nearest_on_float32_weights_is_torch_adamw_bit_for_bit():
    # Without weight decay torch's AdamW rounds once per weight, as lpsim does: the moments
    # (lerp_, mul_ and addcmul_) and the term (-step_size * m) / denom must be torch's.
    (ours, state), (theirs, their_state) = _steps_of_both(
        lambda p: lpsim.optim.AdamW(p, lr=0.01, weight_decay=0.0, rounding="nearest"),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0, foreach=False),
    )
    assert_same_bits(ours.detach(), theirs.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same_bits(state[key], their_state[key])


@pytest.mark.parametrize("step", [1269, 2581])
def test_adamw_forms_the_bias_correction_of_the_second_moment_as_torch_does(step):
    # torch divides sqrt(v) by (1 - beta2**t) ** 0.5, a pow in double, which differs from
    # math.sqrt(1 - beta2**t) in the last bit at these steps (beta2 = 0.999): for float64 weights
    # at zero the new weights are the terms themselves, so the division must be torch's.
    torch.manual_seed(0)
    n = 256
    m, v = torch.randn(n, dtype=torch.float64), torch.rand(n, dtype=torch.float64) + 0.5
    grad = torch.randn(n, dtype=torch.float64)
    ours = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    theirs = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = lpsim.optim.AdamW([ours], lr=1e-3, weight_decay=0.0, rounding="nearest")
    their_opt = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.0, foreach=False)
    opt.state[ours].update(step=step, exp_avg=m.clone(), exp_avg_sq=v.clone())
    their_opt.state[theirs] = {
        "step": torch.tensor(float(step)),
        "exp_avg": m.clone(),
        "exp_avg_sq": v.clone(),
    }
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    opt.step()
    their_opt.step()
    assert_same_bits(ours.detach(), theirs.detach())


@pytest.mark.parametrize("option", ["maximize", "amsgrad", "foreach", "fused"])
@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_a_group_asking_for_a_torch_option_not_implemented_is_refused_not_ignored(
    optimizer, option
):
    # A parameter group may carry any key: {"maximize": True} used to be stepped as a minimization.
    w = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match=f"{option} must be False or None"):
        optimizer([{"params": [w], option: True}], seed=0)
    opt = optimizer([torch.zeros(2, requires_grad=True)], seed=0)
    with pytest.raises(ValueError, match=f"{option} must be False or None"):
        opt.add_param_group({"params": [w], option: True})
    assert len(opt.param_groups) == 1
    # The values torch gives by default are accepted, and then the step is torch's.
    theirs = torch.ones(4, requires_grad=True)
    ours_opt = optimizer([{"params": [w], option: False}], lr=0.1, seed=0, rounding="nearest")
    torch_opt = getattr(torch.optim, optimizer.__name__)([theirs], lr=0.1, foreach=False)
    w.grad, theirs.grad = torch.ones(4), torch.ones(4)
    ours_opt.step()
    torch_opt.step()
    if optimizer is lpsim.optim.SGD:
        assert_same_bits(w.detach(), theirs.detach())


@pytest.mark.parametrize(
    "optimizer,option",
    [
        (lambda p: lpsim.optim.SGD(p, lr=0.1, seed=0), "maximize"),
        (lambda p: lpsim.optim.AdamW(p, lr=0.1, seed=0), "maximize"),
        (lambda p: lpsim.optim.AdamW(p, lr=0.1, seed=0), "amsgrad"),
        (lambda p: lpsim.optim.FusedAdam(p, lr=0.1), "amsgrad"),
    ],
    ids=["SGD-maximize", "AdamW-maximize", "AdamW-amsgrad", "FusedAdam-amsgrad"],
)
def test_a_torch_option_set_on_a_group_after_it_was_made_is_refused_by_the_step(optimizer, option):
    # torch's own optimizers read their options at every step, so a group may be switched to
    # maximisation (or amsgrad) between steps; these optimizers stepped on without it.
    w = torch.nn.Parameter(torch.ones(4))
    opt = optimizer([w])
    opt.param_groups[0][option] = True
    w.grad = torch.ones(4)
    with pytest.raises(ValueError, match=f"{option} must be False"):
        opt.step()
    assert_same_bits(w.detach(), torch.ones(4))


def test_adamw_refuses_a_tensor_lr_set_after_the_group_was_made_naming_lr():
    w = torch.nn.Parameter(torch.ones(4))
    opt = lpsim.optim.AdamW([w], lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor(0.05)  # as a scheduler with a tensor lr sets it
    w.grad = torch.ones(4)
    with pytest.raises(TypeError, match="lr must be a number, got Tensor"):
        opt.step()
    assert_same_bits(w.detach(), torch.ones(4))


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (
            lambda p: lpsim.optim.SGD(p, lr=0.1, momentum=0.9, rounding="nearest"),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        ),
        (
            lambda p: lpsim.optim.AdamW(p, lr=0.01, weight_decay=0.0, rounding="nearest"),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0, foreach=False),
        ),
    ],
    ids=["SGD", "AdamW"],
)
def test_round_to_nearest_leaves_torchs_generator_to_the_script_as_torchs_optimizer_does(
    ours, theirs
):
    """With a deterministic rule nothing needs a seed: making the optimizer and stepping it draw
    nothing from torch's default generator, so the dropout masks and the data order a script
    draws after it are those of the same script with torch's optimizer (which steps float32
    weights to the same bits)."""

    def run(make):
        torch.manual_seed(11)
        w = torch.randn(64, requires_grad=True)
        opt = make([w])
        for _ in range(3):
            mask = torch.rand(64) > 0.2  # what a dropout layer or a data loader draws
            w.grad = torch.randn(64) * mask
            opt.step()
        return w.detach(), torch.get_rng_state()

    w_ours, generator_ours = run(ours)
    w_theirs, generator_theirs = run(theirs)
    assert torch.equal(generator_ours, generator_theirs)
    assert_same_bits(w_ours, w_theirs)


def test_a_group_switched_to_stochastic_rounding_draws_its_seed_once_and_keeps_it():
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    opt = lpsim.optim.SGD([w], lr=1.0, rounding="nearest")
    assert opt.param_groups[0]["seed"] is None
    opt.param_groups[0]["rounding"] = "stochastic"
    torch.manual_seed(2)
    drawn = int(torch.randint(2**63 - 1, ()))  # the seed the step draws, as lpsim.quantize would
    torch.manual_seed(2)
    w.grad = torch.full((4,), -1e-3, dtype=torch.bfloat16)
    opt.step()
    assert opt.param_groups[0]["seed"] == drawn
    assert opt.state_dict()["param_groups"][0]["seed"] == drawn
    update = -w.grad.float()  # lr 1: the step is -grad, computed in float32
    want = lpsim.sr_add(torch.ones(4, dtype=torch.bfloat16), update, seed=drawn, offset=1 << 32)
    assert_same_bits(w.detach(), want)


@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_a_resumed_optimizer_adds_groups_with_the_options_of_the_uninterrupted_one(optimizer):
    """torch's loading adds a "differentiable" option to the defaults, which add_param_group then
    copied into every group added after a resume: the resumed run's state_dict differed from the
    uninterrupted run's."""

    def run(resume):
        w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
        opt = optimizer([w], lr=0.1, seed=3)
        w.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
        opt.step()
        if resume:
            saved = opt.state_dict()
            w = w.detach().clone().requires_grad_()
            opt = optimizer([w], lr=0.1, seed=3)
            opt.load_state_dict(saved)
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": 0.5})
        return opt.state_dict()["param_groups"]

    assert run(resume=True) == run(resume=False)


@pytest.mark.parametrize(
    "optimizer", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=lambda c: c.__name__
)
def test_a_group_added_after_a_resume_draws_the_seed_of_the_uninterrupted_run(optimizer):
    # Without seed=, a group added later took the seed the constructor drew: a resumed optimizer,
    # made while the generator was elsewhere, gave it another seed than the uninterrupted run's,
    # and its weights were rounded by other random words.
    def run(resume):
        torch.manual_seed(0)
        w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
        opt = optimizer([w], lr=0.1)
        w.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
        opt.step()
        if resume:
            saved, generator = opt.state_dict(), torch.get_rng_state()
            torch.manual_seed(123)  # the resumed script's own start
            w = w.detach().clone().requires_grad_()
            opt = optimizer([w], lr=0.1)
            opt.load_state_dict(saved)
            torch.set_rng_state(generator)
        v = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
        opt.add_param_group({"params": [v]})
        for _ in range(5):
            w.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
            v.grad = torch.full((64,), 1e-3, dtype=torch.bfloat16)
            opt.step()
        return [w.detach(), v.detach()], [group["seed"] for group in opt.param_groups]

    (tensors, seeds), (resumed, resumed_seeds) = run(False), run(True)
    assert resumed_seeds == seeds
    for a, b in zip(tensors, resumed, strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize("make", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=["SGD", "AdamW"])
def test_an_lr_beyond_the_work_precision_is_refused_as_torch_refuses_it(make):
    # torch's SGD raises for lr = 1e39 on float32 parameters ("cannot be converted to type float
    # without overflow"); the float32 factor -lr was -Inf here and every weight became -Inf.
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.ones(4)
    reference = torch.nn.Parameter(torch.ones(4))
    reference.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="overflow"):
        torch.optim.SGD([reference], lr=1e39).step()
    opt = make([w], lr=1e39)
    refusal = r"lr must be within float32's range \(magnitude at most 3\.40\d+e\+38\)"
    with pytest.raises(ValueError, match=refusal):
        opt.step()
    assert_same_bits(w.detach(), torch.ones(4))
    assert opt.state[w].get("step", 0) == 0
    # float64 parameters take it (their work precision holds 1e39)
    v = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    v.grad = torch.ones(4, dtype=torch.float64)
    make([v], lr=1e39).step()
    assert torch.isfinite(v).all()


@pytest.mark.parametrize(
    "torch_optimizer,options",
    [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.0)),
    ],
    ids=["SGD", "AdamW"],
)
def test_a_torch_optimizers_state_dict_continues_its_run_bit_for_bit(torch_optimizer, options):
    # Loaded, it replaced the groups with ones lacking weight_format, rounding, seed ..., and the
    # parameters' states lacked their stream numbers: the first step raised KeyError, with the
    # optimizer's own groups already gone.
    def set_grads(step, params):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    reference = torch_optimizer(params, foreach=False, **options)
    for step in range(3):
        set_grads(step, params)
        reference.step()
    saved = reference.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = getattr(lpsim.optim, torch_optimizer.__name__)(resumed, rounding="nearest", **options)
    opt.load_state_dict(saved)
    for step in range(3, 6):
        set_grads(step, params)
        reference.step()
        set_grads(step, resumed)
        opt.step()
    for a, b in zip(resumed, params, strict=True):
        assert_same_bits(a.detach(), b.detach())


def test_a_torch_adam_state_dict_with_coupled_weight_decay_is_refused_by_adamw():
    # torch.optim.Adam's L2 weight decay (decoupled_weight_decay=False) would have been taken
    # for AdamW's decoupled one.
    p = torch.nn.Parameter(torch.randn(3))
    adam = torch.optim.Adam([p], weight_decay=0.1)
    p.grad = torch.randn(3)
    adam.step()
    w = torch.nn.Parameter(torch.randn(3))
    opt = lpsim.optim.AdamW([w], rounding="nearest")
    groups = opt.state_dict()["param_groups"]
    with pytest.raises(ValueError, match="decoupled_weight_decay must be True.*got False"):
        opt.load_state_dict(adam.state_dict())
    assert opt.state_dict()["param_groups"] == groups
    w.grad = torch.randn(3)
    opt.step()  # the optimizer still steps


@pytest.mark.parametrize("make", [lpsim.optim.SGD, lpsim.optim.AdamW], ids=["SGD", "AdamW"])
def test_a_weight_format_set_on_a_group_that_one_parameter_cannot_hold_changes_nothing(make):
    # Set after the group was made, a format bfloat16 cannot hold was found only when that
    # parameter's update was rounded: the float32 parameter before it had taken its step, every
    # step count had advanced, and the error named no parameter.
    fits = torch.nn.Parameter(torch.ones(3))
    unfit = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = make([fits, unfit], lr=0.5, rounding="nearest")
    opt.param_groups[0]["weight_format"] = Float(8, 10)
    fits.grad, unfit.grad = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_format \(parameter 1 of group 0\).*bfloat16"):
        opt.step()
    assert_same_bits(fits.detach(), torch.ones(3))
    assert "step" not in opt.state[fits] and "step" not in opt.state[unfit]


def test_nearest_float32_sgd_differs_from_torchs_only_in_the_sign_of_an_inf_minus_inf_nan():
    # An infinite weight and an infinite update of the other sign: torch's sum is the CPU's
    # default NaN, sr_add's a positive one; every other element is torch's, bit for bit.
    inf, nan = float("inf"), float("nan")
    w = torch.tensor([inf, -inf, inf, 1.0, 0.0, -0.0, nan, 2.0])
    grad = torch.tensor([inf, -inf, -inf, inf, 0.0, 1e-40, 1.0, -0.5])
    ours, theirs = w.clone().requires_grad_(), w.clone().requires_grad_()
    mine = lpsim.optim.SGD([ours], lr=1.0, rounding="nearest")
    torchs = torch.optim.SGD([theirs], lr=1.0, foreach=False)
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    mine.step()
    torchs.step()
    made = torch.tensor([True, True, False, False, False, False, False, False])
    bits, their_bits = ours.detach().view(torch.int32), theirs.detach().view(torch.int32)
    assert torch.equal(bits[~made], their_bits[~made])
    assert ours[made].isnan().all() and theirs[made].isnan().all()
    assert (bits[made] >= 0).all()  # sign bit clear
    default_nan = (torch.tensor(inf) + torch.tensor(-inf)).view(torch.int32)
    assert torch.equal(their_bits[made], default_nan.expand(2))


FACTOR_CASES = {
    "sgd_weight_decay": (
        lpsim.optim.SGD,
        torch.optim.SGD,
        dict(lr=0.1, weight_decay=1e39),
        r"^weight_decay must be within",
    ),
    "sgd_dampening": (
        lpsim.optim.SGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.5, dampening=1e39),
        r"^1 - dampening must be within",
    ),
    "sgd_nesterov": (
        lpsim.optim.SGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=1e39, nesterov=True),
        r"^momentum must be within",
    ),
    "adamw_step_size": (
        lpsim.optim.AdamW,
        torch.optim.AdamW,
        dict(lr=1e38),
        r"the step size of step 1, must be within",
    ),
}


@pytest.mark.parametrize("case", FACTOR_CASES.values(), ids=FACTOR_CASES.keys())
def test_a_factor_beyond_the_work_precision_is_refused_before_the_state_changes(case):
    # torch's optimizers raise for these options on float32 parameters ("cannot be converted to
    # type float without overflow"); here torch's error came from within the step, which had
    # already counted it and written the momentum buffer or Adam's moments.
    make, torch_class, options, pattern = case
    refused_step = 2 if "dampening" in options else 1  # dampening applies from step 2 on
    reference = torch.nn.Parameter(torch.tensor([1.0, -0.5]))
    torch_optimizer = torch_class([reference], foreach=False, **options)
    w = torch.nn.Parameter(torch.tensor([1.0, -0.5]))
    optimizer = make([w], rounding="nearest", **options)
    for _ in range(refused_step - 1):
        reference.grad = torch.tensor([0.25, 1.0])
        torch_optimizer.step()
        w.grad = torch.tensor([0.25, 1.0])
        optimizer.step()
    reference.grad = torch.tensor([0.25, 1.0])
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        torch_optimizer.step()
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[w].items()}
    weight = w.detach().clone()
    w.grad = torch.tensor([0.25, 1.0])
    with pytest.raises(ValueError, match=pattern):
        optimizer.step()
    assert_same_bits(w.detach(), weight)
    assert optimizer.state[w].keys() == before.keys()
    for key, value in before.items():
        if torch.is_tensor(value):
            assert_same_bits(optimizer.state[w][key], value)
        else:
            assert optimizer.state[w][key] == value

"""The short way from Python to the ops (lpsim._ops.call through lpsim._C.call), the seeds the ops
draw themselves, the C++ straight-through gradients and the format caches give the results and
the random streams of the long way (torch.ops with explicit seeds), and step aside where
torch.ops must see the call."""

from __future__ import annotations

import pytest
import torch
from support import assert_same_bits
from torch.overrides import TorchFunctionMode

import lpsim
from lpsim import BlockFloat, Fixed, Float, _checks, _ops
from lpsim.rounding import Rounding

FORMATS = [Float(5, 2), Float(8, 7), Fixed(8, 4), Float(4, 3, special="fn", saturate=True)]
RULES = [r.name for r in Rounding]


def _through_torch_ops(x, fmt, rule, seed):
    """quantize the long way: torch.ops with the seed as a tensor."""
    args = fmt.grid_arguments(x.dtype)
    seed_tensor = torch.tensor(seed if seed is not None else 0, dtype=torch.int64)
    return torch.ops.lpsim.quantize_grid(x, *args, int(Rounding[rule]), 32, seed_tensor, 0)


FITTING = [
    (fmt, dtype)
    for fmt in FORMATS
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if lpsim.formats.fitting_container(fmt, dtype) == dtype
]


@pytest.mark.parametrize(("fmt", "dtype"), FITTING, ids=str)
@pytest.mark.parametrize("rule", RULES)
def test_the_short_way_gives_the_bits_of_torch_ops(fmt, rule, dtype):
    x = (torch.randn(257, dtype=torch.float64) * 8).to(dtype)
    assert_same_bits(lpsim.quantize(x, fmt, rule, seed=11), _through_torch_ops(x, fmt, rule, 11))


@pytest.mark.parametrize("seed", [0, 5, 2**63 - 1, 2**63, 2**64 - 1])
def test_seeds_of_64_bits_reach_the_op_unchanged(seed):
    x = torch.randn(300)
    fmt = Float(5, 2)
    wrapped = seed - 2**64 if seed >= 2**63 else seed
    long_way = _through_torch_ops(x, fmt, "stochastic", wrapped)
    assert_same_bits(lpsim.quantize(x, fmt, "stochastic", seed=seed), long_way)


@pytest.mark.parametrize("rule", ["stochastic", "stochastic_equal"])
def test_an_op_without_a_seed_draws_what_draw_seed_draws_and_nothing_more(rule):
    x = torch.randn(1000)
    torch.manual_seed(1234)
    ours = lpsim.quantize(x, Float(5, 2), rule)
    after_ours = torch.rand(3)
    torch.manual_seed(1234)
    seed = int(_checks.draw_seed())
    theirs = lpsim.quantize(x, Float(5, 2), rule, seed=seed)
    after_theirs = torch.rand(3)
    assert_same_bits(ours, theirs)
    assert torch.equal(after_ours, after_theirs)  # one draw, as draw_seed's


def test_sr_add_without_a_seed_draws_what_draw_seed_draws():
    a = torch.randn(500).bfloat16()
    b = torch.randn(500) * 1e-3
    torch.manual_seed(7)
    ours = lpsim.sr_add(a, b)
    torch.manual_seed(7)
    theirs = lpsim.sr_add(a, b, seed=int(_checks.draw_seed()))
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("rule", [r for r in RULES if not Rounding[r].is_stochastic])
def test_rules_without_random_words_leave_torchs_generator_alone(rule):
    torch.manual_seed(3)
    lpsim.quantize(torch.randn(64), Float(5, 2), rule)
    lpsim.quantize_(torch.randn(64), BlockFloat(6), rule)
    lpsim.sr_add(torch.randn(64).bfloat16(), torch.randn(64), rounding=rule)
    drawn = torch.rand(4)
    torch.manual_seed(3)
    torch.randn(64), torch.randn(64), torch.randn(64).bfloat16(), torch.randn(64)
    assert torch.equal(drawn, torch.rand(4))


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_the_op():
    x = torch.randn(10)
    with _Recorder() as recorder:
        y = lpsim.quantize(x, Float(5, 2))
        lpsim.quantize_(x.clone(), Float(5, 2), "stochastic", seed=1)
    assert torch.ops.lpsim.quantize_grid.default in recorder.seen
    assert torch.ops.lpsim.quantize_grid_.default in recorder.seen
    assert_same_bits(y, lpsim.quantize(x, Float(5, 2)))


class _Tagged(torch.Tensor):
    """A subclass whose __torch_function__ counts the calls it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.lpsim.quantize_grid.default:
            cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_sees_the_op_and_gets_the_same_bits():
    x = torch.randn(40)
    tagged = x.as_subclass(_Tagged)
    before = _Tagged.calls
    y = lpsim.quantize(tagged, Float(5, 2), "stochastic", seed=9)
    assert _Tagged.calls == before + 1
    assert_same_bits(
        y.as_subclass(torch.Tensor), lpsim.quantize(x, Float(5, 2), "stochastic", seed=9)
    )


def test_the_short_way_refuses_what_it_does_not_take_and_torch_ops_explains():
    x = torch.randn(4)
    args = list(Float(5, 2).grid_arguments(x.dtype)) + [0, 32, None, 0]
    assert _ops.call_directly("quantize_grid", x, *args[:-1]) is NotImplemented
    bad = list(args)
    bad[0] = "three"
    assert _ops.call_directly("quantize_grid", x, *bad) is NotImplemented
    with pytest.raises(RuntimeError):
        _ops.call("quantize_grid", x, *bad)
    assert_same_bits(_ops.call_directly("quantize_grid", x, *args), lpsim.quantize(x, Float(5, 2)))


def test_op_errors_keep_their_python_types_on_the_short_way():
    x = torch.randn(4, 4)
    with pytest.raises(IndexError, match="dim"):
        _ops.call("quantize_block", x, 6, 5, None, 0, 32, None, 0)
    with pytest.raises(TypeError):
        _ops.call(
            "quantize_grid", x.int(), *Float(5, 2).grid_arguments(torch.float32), 0, 32, None, 0
        )


def test_the_gradient_is_straight_through_and_built_in_cpp():
    x = torch.randn(6, 5, requires_grad=True)
    y = lpsim.quantize(x, Float(5, 2), "stochastic", seed=4)
    assert type(y.grad_fn).__name__ == "CppFunction"
    assert y.grad_fn.name() == "lpsim::quantize_grid_backward"
    g = torch.randn(6, 5)
    y.backward(g)
    assert_same_bits(x.grad, g)
    with torch.no_grad():
        assert lpsim.quantize(x, Float(5, 2)).grad_fn is None
    assert lpsim.quantize(x.detach(), Float(5, 2)).grad_fn is None


def test_the_gradient_of_a_non_contiguous_input_has_its_shape():
    base = torch.randn(5, 8, requires_grad=True)
    y = lpsim.quantize(base.t(), BlockFloat(6, dim=1))
    (y * 2).sum().backward()
    assert torch.equal(base.grad, torch.full((5, 8), 2.0))


def test_sr_adds_gradient_reaches_both_operands_in_their_dtypes():
    a = torch.randn(7, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    y = lpsim.sr_add(a, b, seed=1)
    g = torch.randn(7, dtype=torch.bfloat16)
    y.backward(g)
    assert a.grad.dtype == torch.bfloat16 and torch.equal(a.grad, g)
    assert b.grad.dtype == torch.float64 and torch.equal(b.grad, g.double())


def test_gradcheck_of_the_identity_gradient_in_float64():
    fmt = Float(11, 52)  # float64's own grid: quantize is the identity, so gradcheck applies
    x = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: lpsim.quantize(t, fmt), (x,))
    assert torch.autograd.gradgradcheck(lambda t: lpsim.quantize(t, fmt) * t, (x,))


def test_equal_formats_share_one_grid():
    assert Float(5, 2).grid() is Float(5, 2).grid()
    assert Fixed(8, 4).grid() is Fixed(8, 4).grid()
    assert Float(5, 2, saturate=True).grid() is not Float(5, 2).grid()
    x = torch.randn(16)
    assert Float(5, 2).grid_arguments(x.dtype) is Float(5, 2).grid_arguments(x.dtype)

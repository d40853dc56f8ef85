"""The fusable form of grid rounding (lpsim.fusable) equals the C++ kernel bit for bit, NaN payloads
and signed zeros included: over every float16 and bfloat16 bit pattern, over adversarial and random
float32 and float64 inputs, for every deterministic rule; compiled by Inductor it still does, fused
into the producing kernel; lpsim.quantize under torch.compile uses it for deterministic rules on
Float and Fixed formats and keeps the custom op otherwise; and an injected resnet18 training step
compiles with fullgraph=True."""

import math
import re

import pytest
import torch
from support import assert_same_bits, neighbourhood, next_down, next_up
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import lpsim
from lpsim import BlockFloat, Fixed, Float, Rounding
from lpsim import reference as ref
from lpsim.formats import CONTAINERS, check_fits
from lpsim.fusable import FUSABLE_RULES, compiled_quantize, compiled_quantize_, quantize_grid_torch

pytestmark = pytest.mark.usefixtures("one_thread")

_BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
_NO_SEED = torch.zeros((), dtype=torch.int64)


def _kernel(x: torch.Tensor, fmt, rule: Rounding) -> torch.Tensor:
    return torch.ops.lpsim.quantize_grid(x, *fmt.grid(), int(rule), 32, _NO_SEED, 0)


def _assert_identical(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, context: str):
    """Every bit equal, NaN payloads and signed zeros included; the message shows the inputs."""
    assert got.dtype == want.dtype and got.shape == want.shape, context
    g = got.detach().contiguous().view(_BITS[got.dtype])
    w = want.detach().contiguous().view(_BITS[want.dtype])
    differ = g != w
    if bool(differ.any()):
        where = differ.flatten().nonzero().flatten()[:6].tolist()
        xs = x.detach().contiguous().flatten()
        rows = ", ".join(
            f"x={xs[i].item()!r} ({xs.view(_BITS[x.dtype])[i].item():#x}): "
            f"got {got.flatten()[i].item()!r}, want {want.flatten()[i].item()!r}"
            for i in where
        )
        raise AssertionError(f"{context}: {int(differ.sum())} elements differ: {rows}")


def _fits(fmt, dtype) -> bool:
    try:
        check_fits(fmt, dtype)
    except ValueError:
        return False
    return True


def _check_every_rule(x: torch.Tensor, fmt) -> None:
    for rule in FUSABLE_RULES:
        _assert_identical(
            quantize_grid_torch(x, fmt.grid(), rule),
            _kernel(x, fmt, rule),
            x,
            f"{fmt!r} {rule.name} {x.dtype}",
        )


# ---- Every 16-bit pattern


_FLOAT_VARIANTS = [
    {},
    {"subnormals": False},
    {"saturate": True},
    {"special": "fn"},
    {"special": "fn", "saturate": True},
    {"special": "fnuz"},
    {"special": "none"},
    {"special": "none", "saturate": True},
]
_SMALL_FORMATS = (
    [Float(exp, man) for exp in range(2, 6) for man in range(4)]
    + [Float(exp, exp - 1, **v) for exp in range(2, 6) for v in _FLOAT_VARIANTS[1:]]
    + [
        Float(5, 2, special="fnuz", subnormals=False),  # normal range below float16's
        Float(3, 1, bias=-2),
        Float(4, 0, special="fn"),
        Float(2, 0, special="none", subnormals=False),
        Fixed(5, 2),
        Fixed(5, 2, signed=False),
        Fixed(5, 2, symmetric=True),
        Fixed(5, 2, clamp=False),
        Fixed(4, -3),
        Fixed(8, 12),
        Fixed(11, 3),
        Fixed(3, 20, signed=False, clamp=False),
    ]
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_rounds_as_the_kernel_does(dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    checked = 0
    for fmt in _SMALL_FORMATS:
        if _fits(fmt, dtype):
            _check_every_rule(x, fmt)
            checked += 1
    assert checked >= 40


# ---- float32 and float64: adversarial and random inputs

_NAN_PAYLOADS = {
    torch.float32: [0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FC12345],
    torch.float64: [0x7FF8000000000000, 0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF],
}


def _adversarial(fmt, dtype: torch.dtype) -> torch.Tensor:
    """Inputs at and around every rounding decision of fmt in the container ``dtype``: in every
    binade of the container, the first and last few grid points, a few inside, the midpoints after
    them; the limits and the points past them up to the next binade; the powers of two; container
    subnormals; each with its container neighbours, both signs; then +/-0, +/-Inf and NaNs with
    several payloads (both signs)."""
    c = CONTAINERS[dtype]
    grid = fmt.grid()
    keep = c.man if grid.keep < 0 or grid.keep > c.man else grid.keep
    e = torch.arange(c.qmin, c.emax + 1, dtype=torch.float64)  # every binade 2**e of the container
    flushed = (e < grid.emin) if not grid.subnormals else torch.zeros_like(e, dtype=torch.bool)
    finest = torch.where(flushed, float(grid.emin), float(grid.qmin))
    quantum = torch.maximum(e - keep, finest)
    steps = torch.tensor([0, 1, 2, 3, 5, 7, 0.5, 1.5, 2.5, 3.5], dtype=torch.float64)
    binade = torch.exp2(e)[:, None]
    q = torch.exp2(quantum)[:, None]
    points = [
        (binade + steps * q).flatten(),
        (2 * binade - steps * q).flatten(),
        (binade * 1.5 + steps * q).flatten(),  # inside the binade
        torch.exp2(quantum) * 0.5,  # half the spacing (the tie below the smallest values)
    ]
    limits = [fmt.max] + ([-fmt.min] if isinstance(fmt, Fixed) and fmt.signed else [])
    for limit in limits:
        if math.isfinite(limit) and limit > 0:
            top = math.ldexp(1.0, math.frexp(limit)[1] - 1)  # the limit's binade
            step = math.ldexp(top, -keep) if isinstance(fmt, Float) else fmt.eps
            k = torch.arange(-4, 9, dtype=torch.float64)
            points.append(limit + k * (step / 4))  # Inf past float64's range: dropped below
            points.append(torch.tensor([top, step / 2, step], dtype=torch.float64) * 2)
    v = torch.cat(points).to(dtype)
    v = v[torch.isfinite(v)]
    subnormal_bits = torch.tensor([1, 2, 3, 2 ** (c.man - 1), 2**c.man - 1], dtype=torch.int64)
    v = torch.cat([v, subnormal_bits.to(_BITS[dtype]).view(dtype)])
    v = torch.cat([v, next_up(v), next_down(v)])
    v = torch.cat([v, -v])
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf], dtype=dtype)
    nans = torch.tensor(_NAN_PAYLOADS[dtype], dtype=torch.int64).to(_BITS[dtype]).view(dtype)
    return torch.cat([v, specials, nans, -nans])


def _random_patterns(dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """``count`` uniformly random bit patterns of the container (NaNs and Infs included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.iinfo(_BITS[dtype]).bits
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return torch.randint(low, high, (count,), generator=g, dtype=_BITS[dtype]).view(dtype)


def _random_in_range(fmt, dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """``count`` container values with random fraction bits and exponent fields from below fmt's
    finest spacing (container subnormals included) to above its largest value, both signs."""
    g = torch.Generator().manual_seed(seed)
    c = CONTAINERS[dtype]
    top = math.floor(math.log2(fmt.max)) + 3 if math.isfinite(fmt.max) else c.emax
    low = fmt.grid().qmin - 3
    lowest = max(low + c.bias, 0)  # field 0: subnormals
    fields = (lowest, max(lowest, min(top + c.bias, 2**c.exp - 2)))
    field = torch.randint(fields[0], fields[1] + 1, (count,), generator=g, dtype=torch.int64)
    fraction = torch.randint(0, 2**c.man, (count,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (count,), generator=g, dtype=torch.int64) << (c.exp + c.man)
    bits = sign | (field << c.man) | fraction
    if dtype == torch.float32:
        bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(_BITS[dtype]).view(dtype)


FLOAT32_FORMATS = [
    Float(8, 7),  # bfloat16
    Float(8, 7, subnormals=False),
    Float(5, 10),  # float16
    Float(8, 10),  # tf32
    Float(8, 23),  # float32 itself
    Float(4, 3),
    Float(4, 3, special="fn"),
    Float(4, 3, special="fn", saturate=True),
    Float(4, 3, special="fnuz"),
    Float(5, 2),
    Float(5, 2, subnormals=False),
    Float(5, 2, special="fnuz"),
    Float(3, 2, special="none", saturate=True),
    Float(2, 1, special="none", saturate=True),
    Float(8, 1, bias=140),  # normal range below float32's smallest normal
    Float(8, 3, bias=135, subnormals=False),  # flushes below float32's smallest normal
    Fixed(8, 4),
    Fixed(8, 6, signed=False),
    Fixed(8, 6, symmetric=True),
    Fixed(16, 8, clamp=False),
    Fixed(24, 12),
    Fixed(12, -3),
    Fixed(20, 149),  # spacing: float32's smallest subnormal
    Fixed(24, -100),
]

FLOAT64_FORMATS = [
    Float(11, 52),  # float64 itself
    Float(8, 23),
    Float(8, 7),
    Float(5, 10),
    Float(4, 3, special="fn"),
    Float(5, 2, subnormals=False),
    Float(9, 30),
    Float(11, 40, subnormals=False),
    Float(10, 3, bias=1000),
    Fixed(53, 20),
    Fixed(32, 1074),  # spacing: float64's smallest subnormal
    Fixed(40, -900),
    Fixed(16, 8, signed=False, clamp=False),
]


@pytest.mark.parametrize("fmt", FLOAT32_FORMATS, ids=repr)
def test_float32_adversarial_and_random_inputs_round_as_the_kernel_does(fmt):
    x = torch.cat(
        [
            _adversarial(fmt, torch.float32),
            _random_patterns(torch.float32, 2**20, seed=1),
            _random_in_range(fmt, torch.float32, 2**16, seed=2),
        ]
    )
    _check_every_rule(x, fmt)


@pytest.mark.parametrize("fmt", FLOAT64_FORMATS, ids=repr)
def test_float64_adversarial_and_random_inputs_round_as_the_kernel_does(fmt):
    x = torch.cat(
        [
            _adversarial(fmt, torch.float64),
            _random_patterns(torch.float64, 2**18, seed=3),
            _random_in_range(fmt, torch.float64, 2**16, seed=4),
        ]
    )
    _check_every_rule(x, fmt)


@pytest.mark.parametrize(
    "fmt", [Float(3, 2), Float(3, 2, special="fnuz", subnormals=False), Fixed(5, 2)], ids=repr
)
def test_fusable_form_equals_the_exact_oracle(fmt):
    x = neighbourhood(fmt.values(), torch.float32)
    for rule in FUSABLE_RULES:
        got = quantize_grid_torch(x, fmt.grid(), rule)
        assert_same_bits(got, ref.quantize(x, fmt, rule), f"{fmt!r} {rule.name}")


def test_strided_input_gives_the_same_values():
    x = torch.randn(64, 48, dtype=torch.float64).t()[::2]
    got = quantize_grid_torch(x, Float(5, 2).grid(), Rounding.nearest)
    _assert_identical(got, _kernel(x, Float(5, 2), Rounding.nearest), x, "strided")


# ---- compiled_quantize: when it applies, its errors, its gradient


def test_compiled_quantize_declines_what_it_cannot_fuse():
    x = torch.randn(8)
    assert compiled_quantize(x, Float(5, 2), "stochastic") is None
    assert compiled_quantize(x, Float(5, 2), "stochastic_equal", seed=3) is None
    assert compiled_quantize(x, BlockFloat(6), "nearest") is None
    assert compiled_quantize(x, Float(5, 2), "nearest", out=torch.empty(8)) is None
    assert compiled_quantize_(x, BlockFloat(6), "nearest") is None
    y = compiled_quantize(x, Fixed(8, 4), "down")
    _assert_identical(y, lpsim.quantize(x, Fixed(8, 4), "down"), x, "Fixed down")


@pytest.mark.parametrize(
    "call",
    [
        lambda f: f(torch.randn(4), Float(5, 2), "nearst"),
        lambda f: f(torch.randn(4), Float(5, 2), 3),
        lambda f: f(torch.randn(4, dtype=torch.float16), Float(8, 7)),
        lambda f: f(torch.arange(4), Float(5, 2)),
        lambda f: f(torch.randn(4), Float(5, 2), "nearest", rbits=8),
        lambda f: f(torch.randn(4), Float(5, 2), "nearest", offset=-1),
        lambda f: f(torch.randn(4), Float(5, 2), "nearest", seed=-1),
        lambda f: f(torch.randn(4), Float(5, 2), "up", seed=2**64),
        lambda f: f(torch.randn(4), Fixed(8, 4), "nearest", seed=1.5),
        lambda f: f(torch.randn(4), Float(5, 2), "odd", seed=True),
    ],
)
def test_compiled_quantize_raises_what_quantize_raises(call):
    with pytest.raises((TypeError, ValueError)) as expected:
        call(lpsim.quantize)
    with pytest.raises(expected.type, match=re.escape(str(expected.value)[:40])):
        call(compiled_quantize)
    with pytest.raises(expected.type, match=re.escape(str(expected.value)[:40])):
        call(compiled_quantize_)


def test_a_view_with_the_negative_bit_rounds_as_its_values_do():
    """z.conj().imag holds z's imaginary parts negated (torch's negative bit, not in its storage):
    the fusable form rounds its values, as torch's float8_e5m2 cast does, out of place and in
    place (the integer view of such a tensor once raised, so torch.compile failed where eager
    calls worked)."""
    z = torch.complex(torch.randn(300), torch.randn(300) * 1000)
    want = z.conj().imag.to(torch.float8_e5m2).float()
    assert torch.equal(
        quantize_grid_torch(z.conj().imag, Float(5, 2).grid(), Rounding.nearest), want
    )
    assert torch.equal(compiled_quantize(z.conj().imag, Float(5, 2)), want)
    view = z.conj().imag
    assert compiled_quantize_(view, Float(5, 2)) is view
    assert torch.equal(view, want) and torch.equal(z.imag, -want)
    compiled = torch.compile(lambda t: lpsim.quantize(t.conj().imag, Float(5, 2)), backend="eager")
    assert torch.equal(compiled(z), want)


def test_compiled_quantize_gradient_is_straight_through():
    x = torch.tensor([0.3, -0.0, -1e-9, 1e6, -math.inf, math.nan], requires_grad=True)
    y = compiled_quantize(x, Float(4, 3, special="fn"), "nearest")
    _assert_identical(y, _kernel(x.detach(), Float(4, 3, special="fn"), Rounding.nearest), x, "")
    grad = torch.tensor([1.0, -2.0, 3.0, -0.0, 5.0, 6.0])
    y.backward(grad)
    _assert_identical(x.grad, grad, x, "gradient")


def test_compiled_per_sample_gradients_through_a_deterministic_quantize_are_straight_through():
    """torch.compile(vmap(grad(loss))) with a Fixed format under a deterministic rule: the
    per-sample gradient of sum(q(x * w)**2) is 2 q(x * w) x (straight-through), as in eager mode.
    It raised: the fusable form's autograd.Function, which dynamo cannot vmap (now the custom
    op rounds there, as under torch.func in eager mode), and under fullgraph=True the check for
    an active transform broke the graph. The oracle
    rounds by hand: Fixed(6, 3) toward -inf is floor(v * 8) / 8, clamped to [-4, 31 / 8]."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(8, generator=gen)
    xs = torch.randn(5, 8, generator=gen) * 4
    fmt = Fixed(6, 3)

    def loss(w, x):
        return (lpsim.quantize(x * w, fmt, "down") ** 2).sum()

    def per_sample(w, xs):
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs)

    got = torch.compile(per_sample, backend="aot_eager", fullgraph=True)(w, xs)
    q = ((xs * w) * 8).floor().div(8).clamp(-4, 31 / 8)
    assert_same_bits(got, (2 * q) * xs)


def test_compiled_quantize_in_place_writes_x_and_bumps_its_version():
    x = torch.randn(100)
    want = lpsim.quantize(x, Float(4, 3), "odd")
    version = x._version
    assert compiled_quantize_(x, Float(4, 3), "odd") is x
    _assert_identical(x, want, x, "in place")
    assert x._version > version
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        compiled_quantize_(leaf, Float(4, 3), "nearest")


# ---- Under torch.compile


class _Graphs:
    """A backend that records the ATen-level graphs (forward and backward) that AOTAutograd hands
    to the compiler, and runs them as they are."""

    def __init__(self):
        self.graphs = []

        def record(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=record, bw_compiler=record)

    def lpsim_ops(self) -> list[str]:
        """The lpsim ops the graphs call, directly or through a higher-order op (an in-place op
        is called through auto_functionalized)."""
        return [
            str(target)
            for gm in self.graphs
            for node in gm.graph.nodes
            if node.op == "call_function"
            for target in (node.target, *node.args)
            if getattr(target, "namespace", None) == "lpsim"
        ]


def _inputs() -> dict:
    return {
        torch.float32: _adversarial(Float(5, 2), torch.float32),
        torch.float64: _adversarial(Fixed(12, 5), torch.float64),
        torch.bfloat16: torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16),
        torch.float16: torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16),
    }


_COMPILED_CASES = [
    (torch.float32, Float(5, 2), Rounding.nearest),
    (torch.float32, Float(4, 3, special="fn", saturate=True), Rounding.up),
    (torch.float64, Fixed(12, 5), Rounding.nearest_away),
    (torch.float64, Float(8, 7, subnormals=False), Rounding.odd),
    (torch.bfloat16, Float(4, 3, special="fnuz"), Rounding.down),
    (torch.bfloat16, Fixed(6, 3, signed=False), Rounding.nearest_zero),
    (torch.float16, Float(5, 2, special="fnuz", subnormals=False), Rounding.away),
    (torch.float16, Float(3, 2, special="none", saturate=True), Rounding.toward_zero),
]


def test_inductor_compiled_fusable_form_is_bit_identical_and_one_kernel():
    """One compiled function rounds float32, float64, bfloat16 and float16 inputs by every rule;
    Inductor's code equals the kernel bit for bit and calls no lpsim op."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    inputs = _inputs()
    inputs[torch.bfloat16] = inputs[torch.bfloat16].view(torch.bfloat16)
    inputs[torch.float16] = inputs[torch.float16].view(torch.float16)

    def f(xs):
        return [compiled_quantize(xs[d], fmt, rule) for d, fmt, rule in _COMPILED_CASES]

    got, code = run_and_get_code(torch.compile(f, fullgraph=True), inputs)
    for y, (d, fmt, rule) in zip(got, _COMPILED_CASES):
        _assert_identical(y, _kernel(inputs[d], fmt, rule), inputs[d], f"{fmt!r} {rule.name}")
    source = "\n".join(code)
    assert "lpsim" not in source


def test_compiled_quantize_fuses_into_the_producing_kernel():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x = _adversarial(Float(5, 2), torch.float32)

    def f(x):
        return compiled_quantize(x * 2 + 1, Float(5, 2), "nearest")

    got, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    _assert_identical(got, _kernel(x * 2 + 1, Float(5, 2), Rounding.nearest), x, "fused")
    source = "\n".join(code)
    assert source.count('extern "C"') == 1  # one kernel: x * 2 + 1 and the rounding
    assert "lpsim" not in source


# These tests exercise lpsim.quantize itself under torch.compile: they need the wiring in
# lpsim.functional (quantize calls compiled_quantize while compiling).


@pytest.mark.parametrize(
    "d,fmt,rule", _COMPILED_CASES, ids=[f"{d}-{f!r}-{r.name}" for d, f, r in _COMPILED_CASES]
)
def test_compiled_lpsim_quantize_uses_no_custom_op_for_deterministic_rules(d, fmt, rule):
    torch._dynamo.reset()
    x = _inputs()[d].view(d) if d in (torch.bfloat16, torch.float16) else _inputs()[d]
    x = x.clone().requires_grad_()
    graphs = _Graphs()
    compiled = torch.compile(
        lambda x: lpsim.quantize(x, fmt, rule), fullgraph=True, backend=graphs.backend
    )
    y = compiled(x)
    y.backward(torch.ones_like(y))
    assert graphs.lpsim_ops() == []
    _assert_identical(y, _kernel(x.detach(), fmt, rule), x, f"{fmt!r} {rule.name}")
    assert bool((x.grad == 1).all())


def test_compiled_lpsim_quantize_in_place_uses_no_custom_op():
    torch._dynamo.reset()
    graphs = _Graphs()

    def f(t):
        lpsim.quantize_(t, Float(3, 1), "nearest")
        return t * 2

    t = _adversarial(Float(3, 1), torch.float32)
    want = _kernel(t, Float(3, 1), Rounding.nearest)
    got = torch.compile(f, fullgraph=True, backend=graphs.backend)(t)
    assert graphs.lpsim_ops() == []
    _assert_identical(t, want, t, "in place")
    _assert_identical(got, want * 2, t, "returned")


@pytest.mark.parametrize(
    "fmt,rule",
    [(Float(5, 2), "stochastic"), (Fixed(8, 4), "stochastic_equal"), (BlockFloat(6), "nearest")],
    ids=repr,
)
def test_compiled_lpsim_quantize_keeps_the_custom_op_for_stochastic_rules_and_blocks(fmt, rule):
    torch._dynamo.reset()
    graphs = _Graphs()
    x = torch.randn(64)
    f = torch.compile(
        lambda x: lpsim.quantize(x, fmt, rule, seed=7), fullgraph=True, backend=graphs.backend
    )
    got = f(x)
    assert len(graphs.lpsim_ops()) == 1
    assert_same_bits(got, lpsim.quantize(x, fmt, rule, seed=7))


@pytest.mark.parametrize(
    "fmt,ops",
    [
        (lpsim.P3109(8, 1), 0),  # precision 1: ties by the exponent code's parity
        (lpsim.P3109(6, 3, signed=False, domain="finite", saturation="SatPropagate"), 0),
        (lpsim.scaled.SCALED_PRESETS["mxfp8_e4m3"], 1),
    ],
    ids=repr,
)
def test_compiled_lpsim_quantize_fuses_p3109_formats_and_keeps_the_op_for_scaled_ones(fmt, ops):
    # The documented split: P3109 formats are grid formats and take the fusable form (no lpsim op
    # in the graph), Scaled formats keep their custom op; both give eager's bits.
    torch._dynamo.reset()
    graphs = _Graphs()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(6)) * 16
    x[:4] = torch.tensor([0.0, -0.0, math.inf, math.nan])
    got = torch.compile(
        lambda x: lpsim.quantize(x, fmt, "nearest"), fullgraph=True, backend=graphs.backend
    )(x)
    assert len(graphs.lpsim_ops()) == ops
    assert_same_bits(got, lpsim.quantize(x, fmt, "nearest"))


def test_eager_lpsim_quantize_keeps_the_compiled_kernel():
    # Outside torch.compile the fusable form is not used: quantize and quantize_ call the C++ op
    # once each, and no elementwise torch op (the fusable form's shifts and wheres) runs.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(64)
    for fmt in (Float(5, 2), Fixed(8, 3), lpsim.P3109(8, 1)):
        for rule in FUSABLE_RULES:
            with Record() as record:
                lpsim.quantize(x, fmt, rule)
                lpsim.quantize_(x.clone(), fmt, rule)
            assert [op for op in record.ops if not op.startswith("aten.clone")] == [
                "lpsim.quantize_grid.default",
                "lpsim.quantize_grid_.default",
            ], (fmt, rule)


# ---- An injected model


def test_injected_resnet18_training_step_compiles_without_a_graph_break():
    """The bfloat16 recipe's quantisers (weights, biases, outputs, errors; nearest) in resnet18:
    forward, loss and backward compile as one graph (fullgraph=True raises on a break), and the
    compiled loss and gradients equal the eager ones bit for bit. The error quantisers run inside an
    autograd.Function's backward, which dynamo traces while it traces forward."""
    torchvision = pytest.importorskip("torchvision")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    lpsim.nn.inject(model, lpsim.recipes.BFLOAT16.layers(model), unmatched="ignore")
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])

    def step(x, labels):
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        return loss

    def compiled_step(x, labels):
        loss = torch.compile(
            lambda x, labels: torch.nn.functional.cross_entropy(model(x), labels),
            fullgraph=True,
            backend="aot_eager",
        )(x, labels)
        loss.backward()
        return loss

    want = step(x, labels)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got = compiled_step(x, labels)
    assert_same_bits(got, want)
    for (name, p), grad in zip(model.named_parameters(), grads):
        assert_same_bits(p.grad, grad, name)


@pytest.mark.parametrize("copy_with", ["deepcopy", "torch.load"])
def test_a_copied_injected_model_compiles_with_dynamic_shapes_as_the_original(copy_with):
    """A model injected with two error formats, copied (copy.deepcopy, as for an EMA or a
    reference model, or saved and loaded whole), compiled with dynamic=True and fullgraph=True:
    its outputs and gradients equal the original's eager ones bit for bit over batch sizes that
    change. Before, a copied format stored no grid until its first eager use, so dynamo read the
    second format's limits as symbolic floats inside the error quantiser's autograd.Function
    and the compilation failed with an internal error."""
    import copy  # noqa: PLC0415
    import io  # noqa: PLC0415

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU()
    )
    spec = lpsim.nn.LayerQuantization
    lpsim.nn.inject(
        model,
        {
            torch.nn.Linear: spec(error=(Float(5, 2), "nearest")),
            torch.nn.ReLU: spec(output=(Float(4, 1), "nearest"), error=(Float(4, 1), "nearest")),
        },
    )
    if copy_with == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    compiled = torch.compile(copied, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 4)
        want, got = model(x), compiled(x)
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        assert_same_bits(got, want)
        for p, q in zip(model.parameters(), copied.parameters(), strict=True):
            assert_same_bits(q.grad, p.grad)


def test_models_injected_with_different_formats_compile_one_after_another():
    """Two models of one class with other formats, compiled in one process: dynamo's second trace
    sees the grids' limits change between calls and would make them symbolic floats (lifted
    inside the error quantiser's autograd.Function, which it refused); the constants of a stored
    grid are computed at trace time instead (fusable.format_constants), and each compiled model's
    output and gradient equal the eager ones bit for bit, also for a model re-injected under its
    compiled module and for formats made inside the traced function."""
    torch._dynamo.reset()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    weights = torch.linspace(-1e-3, 1e3, 1000)

    def injected(fmt):
        model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU())
        spec = lpsim.nn.LayerQuantization(output=(fmt, "nearest"), error=(fmt, "nearest"))
        lpsim.nn.inject(model, {torch.nn.ReLU: spec}, unmatched="ignore")
        return model

    def run(model):
        xs = x.clone().requires_grad_()
        y = model(xs)
        (y * weights).sum().backward()
        return y.detach(), xs.grad

    for fmt in (Float(5, 10), Float(8, 7), Float(4, 3), Float(5, 10)):
        want = run(injected(fmt))
        got = run(torch.compile(injected(fmt), fullgraph=True, backend="aot_eager"))
        assert_same_bits(got[0], want[0], f"{fmt} output")
        assert_same_bits(got[1], want[1], f"{fmt} gradient")
    model = injected(Float(5, 10))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x)
    lpsim.nn.remove(model)
    spec = lpsim.nn.LayerQuantization(output=(Float(4, 3), "nearest"))
    lpsim.nn.inject(model, {torch.nn.ReLU: spec}, unmatched="ignore")
    assert_same_bits(compiled(x), model(x), "re-injected")
    for fmt in ("Float(5, 2)", "Fixed(8, 4)"):  # a format made inside the traced function
        made_inside = torch.compile(eval(f"lambda x: lpsim.quantize(x, {fmt})"), fullgraph=True)
        assert_same_bits(made_inside(x), lpsim.quantize(x, eval(fmt)), fmt)


# ---- Inductor (the default backend) and dynamo's guards


def test_inductor_compiled_quantize_follows_every_format_rule_and_seed_it_is_given():
    """One Inductor-compiled function takes the format, the rule, the seed, the offset and rbits
    as arguments, or reads the format from a global: each new configuration recompiles (or takes
    a graph made for it) and gives its own bits, never the cached graph of the one before.
    Deterministic cases against torch's casts and round-half-even; stochastic ones against the
    eager call with the same seed, on a non-contiguous input with specials."""
    torch._dynamo.reset()
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 448.0, 500.0, 3.3e38])
    x = torch.cat([x, torch.randn(55, generator=torch.Generator().manual_seed(5)) * 30])
    x = x.reshape(8, 8).t()
    e4m3 = lpsim.preset("e4m3fn_saturating")  # torch's float8_e4m3fn cast
    f = torch.compile(
        lambda x, fmt, rule, seed, offset, rbits: lpsim.quantize(
            x, fmt, rule, seed=seed, offset=offset, rbits=rbits
        )
    )
    fixed = torch.round(x * 16).clamp(-128, 127) / 16
    for fmt, rule, want in [
        (Float(5, 2), "nearest", x.to(torch.float8_e5m2).float()),
        (e4m3, "nearest", x.to(torch.float8_e4m3fn).float()),
        (Fixed(8, 4), "nearest", torch.where(x.isnan(), x, fixed)),
        (Float(8, 7), Rounding.nearest, x.to(torch.bfloat16).float()),
    ]:
        assert_same_bits(f(x, fmt, rule, None, 0, None), want, f"{fmt!r} {rule}")
    draws = []
    for fmt, rule, seed, offset, rbits in [
        (Float(5, 2), "stochastic", 1, 0, None),
        (Float(5, 2), "stochastic", 2, 0, None),
        (Float(5, 2), "stochastic", 2, 7, None),
        (Float(5, 2), "stochastic", 2, 7, 3),
        (e4m3, "stochastic_equal", 2, 7, None),
    ]:
        got = f(x, fmt, rule, seed, offset, rbits)
        want = lpsim.quantize(x, fmt, rule, seed=seed, offset=offset, rbits=rbits)
        assert_same_bits(got, want, f"{fmt!r} {rule} seed={seed} offset={offset} rbits={rbits}")
        draws.append(got)
    assert all(not torch.equal(a, b) for a, b in zip(draws, draws[1:]))  # each call drew anew

    global _GLOBAL_FORMAT
    g = torch.compile(lambda x: lpsim.quantize(x, _GLOBAL_FORMAT, "nearest"))
    for fmt, dtype in [(Float(5, 2), torch.float8_e5m2), (e4m3, torch.float8_e4m3fn)]:
        _GLOBAL_FORMAT = fmt
        assert_same_bits(g(x), x.to(dtype).float(), f"global {fmt!r}")


_GLOBAL_FORMAT = Float(5, 2)


def test_one_fullgraph_function_takes_fixed_formats_that_differ_in_one_field():
    """Fixed(8, 4), then Fixed(8, 3) and Fixed(10, 3) as arguments of one function compiled with
    fullgraph=True: each recompiles and rounds to nearest even on its grid (torch.round, then the
    clamp). Before, dynamo's second trace read the changed field as a symbolic int and check_fits'
    Fractions made it refuse the call."""
    torch._dynamo.reset()
    x = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 40
    compiled = torch.compile(lambda x, fmt: lpsim.quantize(x, fmt), backend="eager", fullgraph=True)
    for wl, fl in [(8, 4), (8, 3), (10, 3), (8, 4)]:
        top = 2 ** (wl - 1)
        want = torch.round(x * 2**fl).clamp(-top, top - 1) / 2**fl
        assert_same_bits(compiled(x, Fixed(wl, fl)), want, f"Fixed({wl}, {fl})")


@pytest.mark.parametrize("rule", ["nearest", "stochastic"])
def test_equal_formats_made_apart_share_one_compiled_graph(rule):
    """A compiled function given a new but equal format at every call (Float(5, 2) written at the
    call site) compiles once: the trace-time constants are keyed by the first equal format, whose
    identity dynamo guards on (not the identity of each new object, which recompiled every call),
    and each call gives the eager bits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 10
    f = torch.compile(lambda x, fmt: lpsim.quantize(x, fmt, rule, seed=4), backend="aot_eager")
    for _ in range(3):
        assert_same_bits(f(x, Float(5, 2)), lpsim.quantize(x, Float(5, 2), rule, seed=4))
    assert counters["stats"]["unique_graphs"] == 1

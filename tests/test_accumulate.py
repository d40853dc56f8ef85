"""lpsim.accumulate: recursive sums and dot products rounded after every operation, against a
float32 sequential sum, the exact oracle (lpsim.reference.sum_rounded / dot_rounded) and
statistics."""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
from lpsim import Fixed, Float, Rounding
from lpsim import reference as ref

ACCS = [
    Float(5, 10),
    Float(8, 7),
    Float(4, 3),
    Float(8, 23),
    Fixed(10, 6),
    Fixed(9, 3, clamp=False),
    Float(3, 2, subnormals=False),
]


def _sequential_float32_sum(values: torch.Tensor) -> torch.Tensor:
    s = values[0].clone()
    for v in values[1:]:
        s = s + v  # one float32 addition, rounded to nearest
    return s


def test_sum_with_float32_accumulator_and_nearest_is_the_sequential_float32_sum():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(1500) * 1e3, torch.randn(1500) * 1e-3, -torch.randn(500) * 1e3])
    x = x[torch.randperm(x.numel())]
    want = _sequential_float32_sum(x)
    assert_same_bits(lpsim.accumulate.sum(x, acc=Float(8, 23)), want, "dim=None")
    assert_same_bits(lpsim.accumulate.sum(x), want, "default accumulator")
    rows = x[:3000].reshape(3, 1000)
    got = lpsim.accumulate.sum(rows, 1)
    assert_same_bits(got, torch.stack([_sequential_float32_sum(r) for r in rows]), "dim=1")
    assert_same_bits(lpsim.accumulate.cumsum(rows, 1)[:, -1], got, "cumsum ends at the sum")


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
def test_own_format_sums_and_products_are_numpys_sequential_arithmetic_in_that_dtype(dtype):
    # numpy (ml_dtypes for bfloat16) adds and multiplies in the dtype itself, each operation
    # correctly rounded (float16 and bfloat16 go through float32, whose double rounding is
    # innocuous at twice their precision plus two). Sums in the dtype's own format, and products
    # rounded into it before they are added, are then the loop s = t_0; s = s + t_k. Inf and NaN
    # terms propagate as numpy's.
    np_dtype = {
        torch.float16: np.float16,
        torch.bfloat16: ml_dtypes.bfloat16,
        torch.float32: np.float32,
        torch.float64: np.float64,
    }[dtype]
    g = torch.Generator().manual_seed(7)
    scale = torch.exp2(torch.randint(-10, 10, (6, 120), generator=g).double())
    x = (torch.randn(6, 120, generator=g, dtype=torch.float64) * scale).to(dtype)
    x[1, 4], x[2, 9], x[3, 0], x[3, 100] = math.nan, math.inf, -math.inf, math.inf
    xn = x.double().numpy().astype(np_dtype)
    own = lpsim.update.own_format(dtype)
    with np.errstate(all="ignore"):
        sums = [functools.reduce(lambda s, t: np_dtype(s + t), row) for row in xn]
        assert_same_bits(
            lpsim.accumulate.sum(x, 1),
            torch.tensor([float(v) for v in sums], dtype=torch.float64).to(dtype),
            "sum",
        )
        if dtype == torch.float64:
            return  # lpsim.accumulate forms products of 32- and 16-bit operands only
        a, b = x[:, :40], x[:, 40:80].t().contiguous()
        an, bn = xn[:, :40], xn[:, 40:80].T
        want = [
            [
                float(
                    functools.reduce(
                        lambda s, k: np_dtype(s + np_dtype(an[i, k] * bn[k, j])),
                        range(1, 40),
                        np_dtype(an[i, 0] * bn[0, j]),
                    )
                )
                for j in range(6)
            ]
            for i in range(6)
        ]
        got = lpsim.accumulate.matmul(a, b, acc=own, mul=own)
        assert_same_bits(got, torch.tensor(want, dtype=torch.float64).to(dtype), "matmul")


def test_bfloat16_nearest_accumulation_stagnates_and_stochastic_does_not():
    x = torch.full((4096,), 1e-3)
    exact = 4096 * float(torch.tensor(1e-3))
    nearest = lpsim.accumulate.sum(x, acc=Float(8, 7)).item()
    assert nearest < exact / 4  # increments below half a spacing vanish
    stochastic = torch.stack(
        [lpsim.accumulate.sum(x, acc=Float(8, 7), rounding="stochastic", seed=s) for s in range(32)]
    )
    # 4096 steps with spacings up to 2**-5: standard deviation below 2**-5 * sqrt(4096) / 2 = 1.
    assert abs(stochastic.double().mean().item() - exact) <= 4 * 1.0 / math.sqrt(32)


@st.composite
def reductions(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    scale = 2.0 ** draw(st.integers(-6, 6))
    x = torch.tensor(
        draw(
            st.lists(
                st.floats(-1, 1, width=32), min_size=math.prod(shape), max_size=math.prod(shape)
            )
        )
    ).reshape(shape)
    x = (x * scale).to(dtype)
    dim = draw(st.sampled_from([None] + list(range(-len(shape), len(shape)))))
    acc = draw(st.sampled_from(ACCS))
    rule = draw(st.sampled_from(list(Rounding)))
    rbits = draw(st.sampled_from([None, 2, 9])) if rule.is_stochastic else None
    seed = draw(st.integers(0, 2**64 - 1))
    return x, dim, acc, rule, rbits, seed


@given(reductions())
def test_sum_and_cumsum_round_every_partial_sum_exactly_as_the_oracle(case):
    x, dim, acc, rule, rbits, seed = case
    got = lpsim.accumulate.sum(x, dim, acc=acc, rounding=rule, rbits=rbits, seed=seed, offset=5)
    want = ref.sum_rounded(x, dim, acc, rule, rbits=rbits, seed=seed, offset=5)
    assert_same_bits(got, want.reshape(got.shape).to(got.dtype), f"sum {acc!r} {rule.name}")
    if dim is not None:
        got = lpsim.accumulate.cumsum(
            x, dim, acc=acc, rounding=rule, rbits=rbits, seed=seed, offset=5
        )
        want = ref.sum_rounded(x, dim, acc, rule, rbits=rbits, seed=seed, offset=5, cumulative=True)
        assert_same_bits(got, want.reshape(x.shape).to(got.dtype), f"cumsum {acc!r} {rule.name}")


@st.composite
def products(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    m, n, p = draw(st.integers(1, 5)), draw(st.integers(0, 9)), draw(st.integers(1, 4))
    values = st.lists(st.floats(-4, 4, width=32), min_size=m * n + n * p, max_size=m * n + n * p)
    v = torch.tensor(draw(values), dtype=torch.float32).to(dtype)
    a, b = v[: m * n].reshape(m, n), v[m * n :].reshape(n, p)
    acc = draw(st.sampled_from(ACCS))
    mul = draw(st.sampled_from([None, Float(5, 2), Float(8, 7), Fixed(8, 4)]))
    rule = draw(st.sampled_from(list(Rounding)))
    seed = draw(st.integers(0, 2**64 - 1))
    return a, b, acc, mul, rule, seed


@given(products())
def test_matmul_and_matvec_form_exact_products_and_round_every_step_as_the_oracle(case):
    a, b, acc, mul, rule, seed = case
    got = lpsim.accumulate.matmul(a, b, acc=acc, mul=mul, rounding=rule, seed=seed)
    want = ref.dot_rounded(a, b, acc, mul, rule, seed=seed)
    assert_same_bits(got, want.to(got.dtype), f"matmul {acc!r} {mul!r} {rule.name}")
    got = lpsim.accumulate.matvec(a, b[:, 0], acc=acc, mul=mul, rounding=rule, seed=seed)
    want = ref.dot_rounded(a, b[:, :1], acc, mul, rule, seed=seed).reshape(-1)
    assert_same_bits(got, want.to(got.dtype), f"matvec {acc!r} {mul!r} {rule.name}")


def test_products_are_exact_without_a_mul_format():
    # s = -(1 + 2**-11) + (1 + 2**-12)**2 = 2**-24 when the product (1 + 2**-11 + 2**-24, which
    # float32 cannot hold) enters the sum exactly; rounded to float32 first (a tie, to even) it is
    # 1 + 2**-11 and the sum is 0.
    a = torch.tensor([[1.0, 1 + 2.0**-12]])
    b = torch.tensor([-(1 + 2.0**-11), 1 + 2.0**-12])
    assert lpsim.accumulate.matvec(a, b, acc=Float(8, 23)).item() == 2.0**-24
    assert lpsim.accumulate.matvec(a, b, acc=Float(8, 23), mul=Float(8, 23)).item() == 0.0


@pytest.mark.parametrize(
    "dtype,acc,want",
    [
        (torch.bfloat16, Float(8, 7), torch.bfloat16),
        (torch.bfloat16, Float(5, 10), torch.float32),
        (torch.float16, Float(8, 7), torch.float32),
        (torch.float32, Float(11, 52), torch.float64),
        (torch.float64, Float(5, 2), torch.float64),
    ],
)
def test_result_dtype_is_the_narrowest_that_holds_the_accumulator(dtype, acc, want):
    x = torch.ones(3, 4, dtype=dtype)
    assert lpsim.accumulate.sum(x, acc=acc).dtype == want
    assert lpsim.accumulate.cumsum(x, 0, acc=acc).dtype == want
    if dtype != torch.float64:
        assert lpsim.accumulate.matmul(x, x.t(), acc=acc).dtype == want


def test_shapes_and_keepdim_follow_torch():
    x = torch.rand(2, 3, 4)
    for dim in (0, 1, 2, -1):
        assert lpsim.accumulate.sum(x, dim).shape == torch.sum(x, dim).shape
        assert (
            lpsim.accumulate.sum(x, dim, keepdim=True).shape
            == torch.sum(x, dim, keepdim=True).shape
        )
        assert lpsim.accumulate.cumsum(x, dim).shape == x.shape
    assert lpsim.accumulate.sum(x).shape == ()
    assert lpsim.accumulate.sum(torch.empty(0)).item() == 0.0
    assert lpsim.accumulate.matmul(torch.rand(3, 0), torch.rand(0, 2)).eq(0).all()


def test_keepdim_without_dim_keeps_every_dimension_as_torch_sum():
    # Small integers: every order of summation gives the same exact sum.
    tensors = (torch.arange(24.0).reshape(2, 3, 4), torch.arange(5.0), torch.tensor(0.5))
    for x in (*tensors, torch.empty(2, 0)):
        for keepdim in (False, True):
            want = torch.sum(x, None, keepdim=keepdim)
            got = lpsim.accumulate.sum(x, keepdim=keepdim, acc=Float(8, 23))
            assert_same_bits(got, want, f"{tuple(x.shape)} keepdim={keepdim}")


@pytest.mark.parametrize("keepdim", [1, 0, None, "no"])
def test_keepdim_must_be_a_bool_as_torch_sum_requires(keepdim):
    # torch.sum refuses an int, None or a str for keepdim; a truthy "no" kept the dimension.
    x = torch.ones(2, 3)
    with pytest.raises(TypeError, match="must be bool"):
        torch.sum(x, 0, keepdim=keepdim)
    with pytest.raises(TypeError, match=f"keepdim must be a bool, got {type(keepdim).__name__}"):
        lpsim.accumulate.sum(x, 0, keepdim=keepdim)


@pytest.mark.parametrize("shape", [(2, 0), (4, 0, 1), (1, 2, 0), (3, 0, 2), (0, 3)])
def test_sum_and_cumsum_beside_an_empty_dimension_give_torchs_empty_or_zero_results(shape):
    x = torch.zeros(shape)
    for dim in range(-len(shape), len(shape)):
        for keepdim in (False, True):
            want = torch.sum(x, dim, keepdim=keepdim)
            assert_same_bits(lpsim.accumulate.sum(x, dim, keepdim=keepdim, acc=Float(5, 10)), want)
        assert_same_bits(lpsim.accumulate.cumsum(x, dim, acc=Float(5, 10)), torch.cumsum(x, dim))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_unclamped_fixed_accumulator_keeps_its_grid_beyond_the_inputs_dtype(dtype):
    # Fixed(9, 3, clamp=False) holds every multiple of 1/8: 2048 + 1 and 2^15 + 2^15 + 1/8 exactly.
    fmt = Fixed(9, 3, clamp=False)
    x = torch.tensor([[2048.0, 1.0, 0.0], [2.0**15, 2.0**15, 2.0**-3]], dtype=dtype)
    want = torch.tensor([2049.0, 2.0**16 + 2.0**-3], dtype=torch.float64)
    assert_same_bits(lpsim.accumulate.sum(x, 1, acc=fmt), want)
    assert_same_bits(lpsim.accumulate.cumsum(x, 1, acc=fmt)[:, -1], want)
    assert_same_bits(lpsim.accumulate.matvec(x, torch.ones(3, dtype=dtype), acc=fmt), want)


@pytest.mark.parametrize("rule", ["stochastic", "stochastic_equal"])
def test_rounding_k_of_result_r_draws_word_2_rn_plus_k_of_quantizes_stream(rule):
    # The documented numbering, k and r from 0: the rounding that gives s_k of result r draws word
    # 2 (r n + k) of the position-keyed stream, the rounding of its product word 2 (r n + k) + 1.
    # lpsim.quantize's element p draws word p of the same stream, so an element holding t_0 at
    # position 2 r n (or the product a[i, 0] b[0, j] at position 2 r n + 1) rounds as s_0 does.
    generator = torch.Generator().manual_seed(8)
    m, n, p = 6, 5, 7
    x = torch.randn(m, p, n, generator=generator)  # sums along dim 2: result r = i p + j
    first = lpsim.accumulate.cumsum(x, 2, acc=Float(5, 2), rounding=rule, seed=9, offset=4)
    r = torch.arange(m * p)
    stream = torch.zeros(2 * m * p * n)
    stream[2 * r * n] = x[:, :, 0].flatten()
    words = lpsim.quantize(stream, Float(5, 2), rule, seed=9, offset=4)
    assert_same_bits(first[:, :, 0].flatten(), words[2 * r * n])
    # A product rounded into mul, with one term per result (n = 1: words 2 r and 2 r + 1) and an
    # accumulator that holds the rounded product exactly.
    a, b = torch.randn(m, 1, generator=generator), torch.randn(1, p, generator=generator)
    ab = lpsim.accumulate.matmul(
        a, b, acc=Float(8, 23), mul=Float(4, 1), rounding=rule, seed=9, offset=4
    )
    products = torch.zeros(2 * m * p, dtype=torch.float64)
    products[2 * r + 1] = (a.double() * b.double()).flatten()  # exact in float64
    words = lpsim.quantize(products, Float(4, 1), rule, seed=9, offset=4)
    assert_same_bits(ab.flatten(), words[2 * r + 1].float())


def test_stochastic_accumulation_is_reproducible_for_any_thread_count():
    torch.manual_seed(3)
    a = torch.rand(37, 500).half()
    b = torch.rand(500, 5).half()
    previous = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(
                lpsim.accumulate.matmul(a, b, acc=Float(5, 10), rounding="stochastic", seed=4)
            )
    finally:
        torch.set_num_threads(previous)
    assert_same_bits(runs[1], runs[0], "2 threads")
    assert_same_bits(runs[2], runs[0], "3 threads")


@pytest.mark.parametrize(
    "call,error,words",
    [
        (
            lambda: lpsim.accumulate.matmul(
                torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
            ),
            TypeError,
            "a must be a float32, bfloat16 or float16 tensor",
        ),
        (
            lambda: lpsim.accumulate.matmul(torch.ones(2, 3), torch.ones(2, 3)),
            ValueError,
            "matmul takes",
        ),
        (
            lambda: lpsim.accumulate.matvec(torch.ones(2, 3), torch.ones(3).half()),
            TypeError,
            "x must have a's dtype",
        ),
        (lambda: lpsim.accumulate.sum(torch.ones(2), 1), IndexError, "dim must be in [-1, 0]"),
        (
            lambda: lpsim.accumulate.sum(torch.ones(2), acc=lpsim.BlockFloat(8)),
            TypeError,
            "acc must be a Float, Fixed or P3109",
        ),
        (
            lambda: lpsim.accumulate.sum(torch.ones(2, dtype=torch.int32)),
            TypeError,
            "x must be a float32",
        ),
        (
            lambda: lpsim.accumulate.cumsum(torch.ones(2), 0, rounding="stochastic", rbits=40),
            ValueError,
            "rbits must be in [1, 32]",
        ),
        (lambda: lpsim.accumulate.cumsum(torch.ones(2, 3), None), TypeError, "dim must be an int"),
        (
            lambda: lpsim.accumulate.matvec(torch.ones(2, 3), torch.ones(4)),
            ValueError,
            "matvec takes a of shape (m, n) and x of shape (n,), got (2, 3) and (4,)",
        ),
    ],
)
def test_bad_arguments_raise_errors_that_name_them(call, error, words):
    import re

    with pytest.raises(error, match=re.escape(words)):
        call()

"""quantize_many_: one call rounds a list of tensors exactly as quantize_ rounds each one with the
stream offset + i, for every rule, dtype, shape and layout, on any thread count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same_bits

import lpsim
from lpsim import BlockFloat, Fixed, Float, Rounding, quantize_, quantize_many_, reference

RULES = [r.name for r in Rounding]
FORMATS = {"e5m2": Float(5, 2), "e4m3fn": lpsim.preset("e4m3fn"), "fixed": Fixed(8, 4)}


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    """Mixed dtypes and shapes, a non-contiguous view, an empty tensor, and tensors long enough to
    cross work items (cpu::kGrain = 16384 elements) and random-word groups."""
    g = torch.Generator().manual_seed(seed)
    scale = 4.0
    return [
        torch.randn(5, 7, generator=g) * scale,
        (torch.randn(40_000, generator=g) * scale).double(),
        (torch.randn(6, 9, generator=g) * scale).t(),
        torch.empty(0),
        (torch.randn(33_000, generator=g) * scale).bfloat16(),
        (torch.randn(300, generator=g) * scale).half(),
        torch.randn(64, 64, generator=g)[::2, 1::3] * scale,
        torch.tensor(2.5),
    ]


def _one_by_one(tensors, fmt, rounding, offset=0, **kwargs):
    copies = [t.clone() for t in tensors]
    for i, t in enumerate(copies):
        quantize_(t, fmt, rounding, offset=offset + i, **kwargs)
    return copies


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("rounding", RULES)
def test_equals_quantize_with_offset_plus_index(fmt, rounding):
    tensors = _tensors()
    want = _one_by_one(tensors, fmt, rounding, offset=11, seed=1234)
    returned = quantize_many_(tensors, fmt, rounding, seed=1234, offset=11)
    assert returned is tensors
    for i, (got, expected) in enumerate(zip(tensors, want)):
        assert_same_bits(got, expected, f"tensors[{i}]")


@pytest.mark.parametrize("rounding", ["stochastic", "stochastic_equal"])
def test_rbits_is_passed_to_every_tensor(rounding):
    tensors = _tensors(1)
    want = _one_by_one(tensors, Float(5, 2), rounding, seed=7, rbits=3)
    quantize_many_(tensors, Float(5, 2), rounding, seed=7, rbits=3)
    for got, expected in zip(tensors, want):
        assert_same_bits(got, expected)


def test_writes_through_non_contiguous_views_into_their_base():
    base = torch.randn(50, 40) * 3
    expected = base.clone()
    quantize_(expected[:, ::2], Float(4, 3), "stochastic", seed=5, offset=1)
    quantize_many_([torch.empty(0), base[:, ::2]], Float(4, 3), "stochastic", seed=5)
    assert_same_bits(base, expected)


def test_unseeded_call_draws_one_seed_as_quantize_does():
    tensors = _tensors(2)
    copies = [t.clone() for t in tensors]
    torch.manual_seed(9)
    quantize_many_(tensors, Float(5, 2), "stochastic")
    after = torch.randint(1000, ())
    torch.manual_seed(9)
    seed = int(lpsim._checks.draw_seed())
    for i, t in enumerate(copies):
        quantize_(t, Float(5, 2), "stochastic", seed=seed, offset=i)
    assert torch.randint(1000, ()) == after  # both consumed one draw
    for got, expected in zip(tensors, copies):
        assert_same_bits(got, expected)
    torch.manual_seed(9)
    x = _tensors(2)[0]
    quantize_many_([x], Float(5, 2), "stochastic")
    torch.manual_seed(9)
    y = _tensors(2)[0]
    quantize_(y, Float(5, 2), "stochastic")
    assert_same_bits(x, y)


def test_deterministic_rules_draw_no_seed():
    torch.manual_seed(3)
    quantize_many_(_tensors(), Float(5, 2), "nearest")
    after = torch.randint(1000, ())
    torch.manual_seed(3)
    assert torch.randint(1000, ()) == after


@pytest.mark.parametrize("fmt", [Float(5, 2), Fixed(8, 4), BlockFloat(8)], ids=repr)
def test_an_unseeded_stochastic_call_draws_its_one_seed_even_for_an_empty_list(fmt):
    # "One seed drawn for the whole call": an empty list consumes it as a list of one empty
    # tensor does, and as quantize_ of an empty tensor does, whatever the format.
    states = []
    for call in (
        lambda: quantize_many_([], fmt, "stochastic"),
        lambda: quantize_many_([torch.empty(0)], fmt, "stochastic"),
        lambda: quantize_(torch.empty(0), fmt, "stochastic"),
    ):
        torch.manual_seed(4)
        call()
        states.append(torch.get_rng_state())
    assert all(torch.equal(state, states[-1]) for state in states)


@pytest.mark.parametrize(
    "fmt", [BlockFloat(4), lpsim.scaled.preset("mxfp4_e2m1")], ids=["block_float", "scaled"]
)
def test_an_unseeded_call_under_torch_compile_draws_its_one_seed_as_in_eager_mode(fmt):
    """Compiled with random ops kept as eager's (fallback_random, as docs/training.md prescribes
    for the eager bits), a BlockFloat or Scaled call without a seed draws one seed from torch's
    generator, as the eager call does: the tensors are rounded with the first draw after
    torch.manual_seed (reference.quantize with that seed, tensor i at offset i), and the next
    draw is the generator's second. A second draw under torch.compile rounded them with another
    seed and shifted every later draw."""

    def step(x):
        tensors = [x.clone(), (2 * x).clone()]
        quantize_many_(tensors, fmt, "stochastic")
        return tensors, torch.randint(2**63 - 1, ())

    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    seed, following = int(torch.randint(2**63 - 1, ())), torch.randint(2**63 - 1, ())
    config = torch._inductor.config
    previous = config.fallback_random
    config.fallback_random = True
    try:
        torch._dynamo.reset()
        torch.manual_seed(5)
        got, drawn_next = torch.compile(step, backend="aot_eager")(x)
    finally:
        config.fallback_random = previous
        torch._dynamo.reset()
    for i, (t, want) in enumerate(zip(got, [x, 2 * x])):
        assert_same_bits(t, reference.quantize(want, fmt, "stochastic", seed=seed, offset=i))
    assert drawn_next == following


@pytest.mark.parametrize(
    "fmt", [BlockFloat(4), lpsim.scaled.preset("mxfp8_e4m3")], ids=["block_float", "scaled"]
)
def test_an_unseeded_call_compiled_by_inductor_leaves_the_callers_tensor_alone(fmt):
    """The call rounds its own tensors, in one graph: int() of its traced seed broke the graph,
    and behind the break torch's Inductor returned x itself for x * 1, so that x was rounded."""

    def step(x):
        tensors = [x * 1]
        quantize_many_(tensors, fmt, "stochastic")
        return tensors[0]

    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True)
        torch.manual_seed(5)
        got = compiled(x)
    finally:
        torch._dynamo.reset()
    assert_same_bits(x, before)
    neighbours = (reference.quantize(x, fmt, "down"), reference.quantize(x, fmt, "up"))
    assert bool(((got == neighbours[0]) | (got == neighbours[1])).all())
    assert not torch.equal(got, x)


def test_empty_list_and_empty_tensors():
    assert quantize_many_([], Float(5, 2), "stochastic", seed=1) == []
    empty = [torch.empty(0), torch.empty(3, 0, dtype=torch.float64)]
    quantize_many_(empty, Float(5, 2), "nearest")
    assert [t.shape for t in empty] == [torch.Size([0]), torch.Size([3, 0])]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_result_does_not_depend_on_the_thread_count(rounding):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            tensors = _tensors(3) + [torch.randn(100_000, generator=torch.Generator()) * 5]
            quantize_many_(tensors, Float(4, 3), rounding, seed=77, offset=2)
            results.append(tensors)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert_same_bits(a, b)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_block_float_is_a_loop_of_quantize(rounding):
    fmt = BlockFloat(6, dim=0)
    tensors = [torch.randn(4, 5), torch.randn(3, 2).double(), torch.randn(7, 3).t()]
    want = _one_by_one(tensors, fmt, rounding, offset=3, seed=8)
    quantize_many_(tensors, fmt, rounding, seed=8, offset=3)
    for got, expected in zip(tensors, want):
        assert_same_bits(got, expected)


@pytest.mark.parametrize(
    "fmt, narrow",
    [
        (Float(5, 2), Float(8, 7)),
        (BlockFloat(8, dim=1), BlockFloat(24, dim=1)),
        (lpsim.scaled.preset("mxfp8_e4m3"), lpsim.Scaled(Float(8, 7), block=4)),
    ],
    ids=["float", "block_float", "scaled"],
)
def test_a_refused_tensor_leaves_every_tensor_unchanged_and_is_named(fmt, narrow):
    """A tensor the call refuses (its dtype does not hold the format, a BlockFloat dim it lacks, a
    leaf that requires grad, an expanded tensor) is refused before any tensor is written, and the
    message names it, for the block and scaled formats (a loop of quantize_) as for the grid
    formats (one call). The loop rounded the tensors before the refused one and raised quantize_'s
    message; an expanded tensor was met by every path only after the others were rounded."""
    leaf = torch.randn(4, 4, requires_grad=True)
    cases = [
        (ValueError, r"tensors\[2\]: .*does not fit a float16", torch.randn(4, 4).half(), narrow),
        (RuntimeError, "leaf Variable that requires grad", leaf, fmt),
        (
            RuntimeError,
            r"tensors\[2\] has elements that share",
            torch.randn(1, 4).expand(4, 4),
            fmt,
        ),
    ]
    if isinstance(fmt, BlockFloat):
        cases.append((IndexError, r"tensors\[2\]: BlockFloat.dim", torch.randn(4), fmt))
    for error, message, bad, f in cases:
        tensors = [torch.randn(4, 4) * 3, torch.randn(3, 8).double(), bad]
        before = [t.detach().clone() for t in tensors]
        with pytest.raises(error, match=message):
            quantize_many_(tensors, f, "stochastic", seed=1)
        for t, b in zip(tensors, before):
            assert_same_bits(t.detach(), b)


def test_version_counters_are_bumped():
    tensors = [torch.randn(3), torch.randn(4)]
    before = [t._version for t in tensors]
    quantize_many_(tensors, Float(5, 2))
    assert [t._version for t in tensors] == [v + 1 for v in before]


def test_refuses_a_leaf_that_requires_grad_in_grad_mode():
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        quantize_many_([torch.randn(2), leaf], Float(5, 2))
    with torch.no_grad():
        quantize_many_([torch.randn(2), leaf], Float(5, 2))


def test_errors_name_the_tensor():
    with pytest.raises(TypeError, match="tensors must be a list or tuple"):
        quantize_many_(torch.randn(3), Float(5, 2))
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor"):
        quantize_many_([torch.randn(3), 1.0], Float(5, 2))
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a float32.*got torch.int32"):
        quantize_many_([torch.randn(3), torch.zeros(3, dtype=torch.int32)], Float(5, 2))
    with pytest.raises(ValueError, match=r"tensors\[2\]: .*does not fit a bfloat16"):
        quantize_many_([torch.randn(3), torch.randn(3), torch.randn(3).bfloat16()], Float(5, 10))
    with pytest.raises(TypeError, match="fmt must be a Float, Fixed, P3109, BlockFloat or Scaled"):
        quantize_many_([torch.randn(3)], "e5m2")
    with pytest.raises(ValueError, match="offset"):
        quantize_many_([torch.randn(3)] * 3, Float(5, 2), "stochastic", seed=1, offset=2**64 - 2)
    with pytest.raises(ValueError, match="rbits"):
        quantize_many_([torch.randn(3)], Float(5, 2), "stochastic", rbits=40)


@pytest.mark.parametrize(
    "fmt", [Float(4, 3), BlockFloat(8), lpsim.scaled.preset("mxfp8_e4m3")], ids=repr
)
def test_sparse_tensors_are_refused_naming_the_tensor(fmt):
    sparse = [torch.randn(4).to_sparse(), torch.randn(2, 3).to_sparse_csr()]
    for t in sparse:
        with pytest.raises(TypeError, match=r"tensors\[1\] is a sparse_.* tensor; .* strided"):
            quantize_many_([torch.randn(3), t], fmt, "stochastic", seed=1)


@pytest.mark.parametrize(
    "fmt", [Float(4, 3), BlockFloat(8), lpsim.scaled.preset("mxfp8_e4m3")], ids=repr
)
def test_tensors_that_share_memory_are_refused(fmt):
    # Once accepted: an element of two tensors was rounded twice (by two streams), or raced.
    buf = torch.randn(96)
    before = buf.clone()
    for tensors in ([buf[:64], buf[32:]], [buf[:32], buf[:32]], [buf[::2], buf[1::2]]):
        with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] overlap in memory"):
            quantize_many_(tensors, fmt, "stochastic", seed=1)
        assert torch.equal(buf, before)  # refused before anything is written
    # Neighbouring views, and empty tensors anywhere, are fine.
    quantize_many_([buf[:32], buf[32:64], buf[:0], buf[64:]], fmt, "stochastic", seed=1)


def test_direct_op_call_checks_the_grid_against_each_dtype():
    grid = Float(5, 10).grid_arguments(torch.float32)
    with pytest.raises(RuntimeError, match="not representable"):
        torch.ops.lpsim.quantize_grid_many_(
            [torch.randn(3), torch.randn(3).bfloat16()], *grid, 0, 32, torch.tensor(0), 0
        )


_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@given(
    shapes=st.lists(st.lists(st.integers(0, 40), max_size=3), max_size=6),
    dtypes=st.lists(_DTYPES, min_size=6, max_size=6),
    rounding=st.sampled_from(RULES),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    transpose=st.booleans(),
)
def test_property_equals_one_by_one(shapes, dtypes, rounding, seed, offset, transpose):
    g = torch.Generator().manual_seed(seed % 2**32)
    tensors = []
    for shape, dtype in zip(shapes, dtypes):
        t = (torch.randn(shape, generator=g) * 8).to(dtype)
        tensors.append(t.t() if transpose and t.dim() == 2 else t)
    fmt = Float(4, 3)
    want = _one_by_one(tensors, fmt, rounding, offset=offset, seed=seed)
    quantize_many_(tensors, fmt, rounding, seed=seed, offset=offset)
    for got, expected in zip(tensors, want):
        assert_same_bits(got, expected)


_FAMILIES = [
    Float(5, 2),
    Float(3, 1, subnormals=False),
    lpsim.preset("e4m3fn"),
    lpsim.preset("e5m2fnuz"),
    Fixed(8, 4),
    Fixed(8, 4, clamp=False),
    Fixed(6, 2, signed=False),
    Fixed(7, 3, symmetric=True),
    BlockFloat(8),
    BlockFloat(6, dim=0),
    BlockFloat(5, block_size=4),
    lpsim.P3109(8, 3),
    lpsim.P3109(6, 2, signed=False, domain="finite", saturation="SatFinite"),
    lpsim.scaled.preset("mxfp8_e4m3"),
    lpsim.scaled.preset("mxfp4_e2m1"),
    lpsim.scaled.preset("nvfp4"),
    lpsim.scaled.preset("fp8_e5m2_row"),
]
_SPECIALS = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, 3e4])


@given(
    shapes=st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=5),
    dtypes=st.lists(_DTYPES, min_size=5, max_size=5),
    fmt=st.sampled_from(_FAMILIES),
    rounding=st.sampled_from(RULES),
    rbits=st.integers(1, 32),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 6),
    view=st.sampled_from(["contiguous", "transposed", "strided"]),
)
def test_property_every_format_family_and_rbits_equals_one_by_one(
    shapes, dtypes, fmt, rounding, rbits, seed, offset, view
):
    g = torch.Generator().manual_seed(seed % 2**32)
    tensors = []
    for shape, dtype in zip(shapes, dtypes):
        t = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-12, 12, (), generator=g)
        if t.numel():
            picks = torch.randint(0, len(_SPECIALS), (t.numel() // 4,), generator=g)
            t.view(-1)[: picks.numel()] = _SPECIALS[picks]
        t = t.to(dtype)
        if view == "transposed" and t.dim() >= 2:
            t = t.transpose(0, -1)
        elif view == "strided" and t.dim() >= 1:
            t = t[::2]
        tensors.append(t)
    rbits = rbits if Rounding.parse(rounding).is_stochastic else None
    want = _one_by_one(tensors, fmt, rounding, offset=offset, seed=seed, rbits=rbits)
    quantize_many_(tensors, fmt, rounding, seed=seed, offset=offset, rbits=rbits)
    for i, (got, expected) in enumerate(zip(tensors, want)):
        assert_same_bits(got, expected, f"tensors[{i}]")


@pytest.mark.parametrize(
    "fmt",
    [
        BlockFloat(4),
        BlockFloat(4, 0),
        lpsim.scaled.preset("mxfp4_e2m1"),
        Float(5, 2),
        Fixed(6, 3, symmetric=True),
        lpsim.P3109(8, 3),
    ],
    ids=repr,
)
def test_every_format_rounds_a_negative_view_in_place_as_quantize_does(fmt):
    # z.conj().imag views z's imaginary parts with torch's negative bit: after quantize_many_ it
    # holds quantize() of its values and z.imag their negatives. Calls alternate deterministic
    # and stochastic rules: torch's fallback for such views corrupted the heap on the in-place op.
    x = torch.randn(6, 32) * 5
    for i, rule in enumerate(["nearest", "stochastic", "up", "stochastic"] * 2):
        z = torch.complex(torch.zeros(6, 32), -x)
        view = z.conj().imag
        other = x.clone()
        quantize_many_([other, view], fmt, rule, seed=i, offset=3)
        want = lpsim.quantize(x, fmt, rule, seed=i, offset=4)
        assert_same_bits(view, want, rule)
        assert_same_bits(z.imag, -want, f"{rule}: the memory")
        assert_same_bits(other, lpsim.quantize(x, fmt, rule, seed=i, offset=3), rule)

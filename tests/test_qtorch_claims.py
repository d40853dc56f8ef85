"""docs/migrating-from-qtorch.md, checked against QPyTorch 0.3.0's own CPU kernels: each claimed
behaviour is observed, and lpsim.compat.qtorch agrees with QPyTorch everywhere except on the
documented differences (exact ties, NaN)."""

import math
import warnings

import pytest
import torch
from support import assert_same_bits

from lpsim.compat import qtorch as compat

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    qq = pytest.importorskip("qtorch.quant")  # compiles its CPU kernels on first import


def test_qtorch_float_nearest_ties_away_and_lpsim_ties_to_even():
    ties = torch.tensor([1.125, 1.375, -1.125, 3.5])
    assert qq.float_quantize(ties, 5, 2, "nearest").tolist() == [1.25, 1.5, -1.25, 3.5]
    assert compat.float_quantize(ties, 5, 2, "nearest").tolist() == [1.0, 1.5, -1.0, 3.5]


def test_qtorch_float_range_saturation_and_specials():
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, 100000.0])
    assert qq.float_quantize(x, 5, 2, "nearest").tolist() == [
        114688.0,
        -114688.0,
        114688.0,
        -114688.0,
        114688.0,
        98304.0,
    ]
    got = compat.float_quantize(x, 5, 2, "nearest")
    assert got[:4].tolist() == [114688.0, -114688.0, 114688.0, -114688.0]
    assert math.isnan(got[4].item()) and got[5].item() == 98304.0


def test_qtorch_exponent_8_behaves_as_ieee_and_man_23_flips_signs():
    x = torch.tensor([3.3e38, math.inf, -math.inf, 1.0])
    assert qq.float_quantize(x, 8, 7, "nearest")[1:].tolist() == [math.inf, -math.inf, 1.0]
    assert compat.float_quantize(x, 8, 7, "nearest")[1:].tolist() == [math.inf, -math.inf, 1.0]
    assert qq.float_quantize(x, 8, 23, "nearest")[3].item() == -1.0  # QPyTorch's sign flip
    assert_same_bits(compat.float_quantize(x, 8, 23, "nearest"), x)


def test_qtorch_fixed_point_ties_to_even_on_cpu_and_block_ties_toward_plus_inf():
    assert qq.fixed_point_quantize(
        torch.tensor([0.125, 0.375, -0.125]), 8, 2, rounding="nearest"
    ).tolist() == [0.0, 0.5, -0.0]
    block = torch.tensor([4.0, 0.5, 1.5, -0.5, -1.5])  # spacing 1: every other value is a tie
    assert qq.block_quantize(block, 4, -1, "nearest").tolist() == [4.0, 1.0, 2.0, 0.0, -1.0]
    assert compat.block_quantize(block, 4, -1, "nearest").tolist() == [4.0, 0.0, 2.0, -0.0, -2.0]


def test_qtorch_stochastic_fixed_point_moves_odd_codes_on_the_grid_and_lpsim_does_not():
    # 1001/256 in FixedPoint(16, 8): x 2^fl = 1001 is odd. When 1001 + r rounds to 1001 or 1002 in
    # float32 (r within 2^-15, half of float32's spacing there, of 0 or 1), subtracting 0.5 makes a
    # tie, which nearbyint rounds to the even neighbour: about 2^-14 of the draws (64 of 2^20)
    # move a step.
    x = torch.full((1 << 20,), 1001 / 256)
    moved = int((qq.fixed_point_quantize(x, 16, 8, rounding="stochastic") != x).sum())
    assert 16 < moved < 256
    assert_same_bits(compat.fixed_point_quantize(x, 16, 8, rounding="stochastic"), x)


@pytest.mark.parametrize("code,down,up", [(32765, 1024, 1024), (32767, 1024, 0)])
def test_qtorch_stochastic_fixed_point_moves_odd_codes_by_float32s_spacing_unless_clamped(
    code, down, up
):
    # code/256 in FixedPoint(16, 8): float32's spacing at code is 2^-9, so r within 2^-10 of 0
    # (of 1) makes a tie rounded down (up): about 2^-10 of the draws each way, 2^-9 in all. The
    # largest value, 32767/256, moves only down: its move up, to 128, is clamped back.
    draws = 1 << 20
    x = torch.full((draws,), code / 256)
    got = qq.fixed_point_quantize(x, 16, 8, rounding="stochastic")
    for expected, moved in ((down, int((got < x).sum())), (up, int((got > x).sum()))):
        assert abs(moved - expected) <= 5 * math.sqrt(expected), moved
    assert_same_bits(compat.fixed_point_quantize(x, 16, 8, rounding="stochastic"), x)


def test_qtorch_stochastic_rounding_ignores_torch_manual_seed():
    x = torch.full((64,), 1.1)
    torch.manual_seed(0)
    a = qq.float_quantize(x, 5, 2, "stochastic")
    torch.manual_seed(0)
    b = qq.float_quantize(x, 5, 2, "stochastic")
    assert not torch.equal(a, b)
    torch.manual_seed(0)
    c = compat.float_quantize(x, 5, 2)
    torch.manual_seed(0)
    assert torch.equal(c, compat.float_quantize(x, 5, 2))


def test_qtorch_stochastic_fixed_point_draws_from_torchs_generator_and_float_and_block_do_not():
    # QPyTorch's CPU fixed-point kernels take torch.rand_like; its float and block kernels take a
    # std::mt19937 seeded from std::random_device.
    x = torch.full((64,), 1.1)
    for call, reproduced in (
        (lambda: qq.fixed_point_quantize(x, 8, 2, rounding="stochastic"), True),
        (lambda: qq.float_quantize(x, 5, 2, "stochastic"), False),
        (lambda: qq.block_quantize(x, 4, -1, "stochastic"), False),
    ):
        torch.manual_seed(0)
        a = call()
        torch.manual_seed(0)
        assert torch.equal(a, call()) == reproduced


def _no_ties(x: torch.Tensor, spacing_of) -> torch.Tensor:
    """x without the elements that lie exactly halfway between two neighbours."""
    q = spacing_of(x)
    return x[((x / q) - (x / q).floor()) != 0.5]


@pytest.mark.parametrize("exp,man", [(5, 2), (4, 3), (8, 7), (5, 10), (3, 4)])
def test_compat_float_agrees_with_qtorch_off_ties(exp, man):
    g = torch.Generator().manual_seed(exp * 31 + man)
    x = torch.randn(20000, generator=g) * torch.exp2(
        torch.randint(-20, 20, (20000,), generator=g).float()
    )
    x = x[x.abs() > 2.0 ** (2 - 2 ** (exp - 1) - man + 2)]  # QPyTorch's subnormal path is its own
    emin = 2 - 2 ** (exp - 1)
    x = _no_ties(
        x, lambda v: torch.exp2(torch.clamp(torch.floor(torch.log2(v.abs())), min=emin) - man)
    )
    assert_same_bits(
        compat.float_quantize(x, exp, man, "nearest"), qq.float_quantize(x, exp, man, "nearest")
    )


@pytest.mark.parametrize("wl,fl,symmetric", [(8, 4, False), (8, 4, True), (12, 6, False)])
def test_compat_fixed_point_agrees_with_qtorch(wl, fl, symmetric):
    x = torch.randn(20000, generator=torch.Generator().manual_seed(wl + fl)) * 2 ** (wl - fl - 2)
    assert_same_bits(
        compat.fixed_point_quantize(x, wl, fl, True, symmetric, "nearest"),
        qq.fixed_point_quantize(x, wl, fl, True, symmetric, "nearest"),
    )


@pytest.mark.parametrize("wl,dim", [(8, -1), (6, 0), (8, 1)])
def test_compat_block_agrees_with_qtorch_off_ties(wl, dim):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(wl))
    ours = compat.block_quantize(x, wl, dim, "nearest")
    theirs = qq.block_quantize(x, wl, dim, "nearest")
    differ = ours != theirs
    # Differences are ties only: both results are one spacing apart around a midpoint input.
    assert bool(((ours - theirs).abs()[differ] > 0).all())
    assert differ.double().mean().item() < 1e-3


def test_top_level_qtorch_names_give_qtorch_numbers():
    # lpsim.float_quantize and lpsim.block_quantize are QPyTorch's functions, not lpsim's IEEE ones.
    import lpsim

    x = torch.tensor([1e5, -3e5, 0.3, 7.1, 1e-6])
    assert_same_bits(
        lpsim.float_quantize(x, 5, 2, "nearest"), qq.float_quantize(x, 5, 2, "nearest")
    )
    blocks = torch.tensor([[8.0, 2.9], [4.2, -6.1]])
    assert_same_bits(
        lpsim.block_quantize(blocks, 4, -1, "nearest"), qq.block_quantize(blocks, 4, -1, "nearest")
    )


def test_qtorch_exponent_8_turns_some_nan_payloads_into_zeros_and_infs_and_lpsim_keeps_nan():
    # NaNs with the bits 0x7FC00000 (torch's), 0x7FFFFFFF, 0xFFFFFFFF (-1) and 0x7F800001.
    bits = torch.tensor([0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32)
    x = bits.view(torch.float32)
    theirs = qq.float_quantize(x, 8, 7, "nearest")
    assert math.isnan(theirs[0].item())
    assert_same_bits(theirs[1:], torch.tensor([-0.0, 0.0, math.inf]))
    assert bool(compat.float_quantize(x, 8, 7, "nearest").isnan().all())


def test_qtorch_fixed_point_turns_tiny_negatives_into_positive_zeros_and_lpsim_keeps_the_sign():
    # QPyTorch's "nearest" computes nearbyint(x 2^fl + 0.5 - 0.5) in float32: the added 0.5
    # absorbs a negative x 2^fl of magnitude at most 2^-26, and the rounded sum is +0. A slightly
    # larger magnitude survives the addition and rounds to -0.0.
    for fl in (1, 4, 8):
        x = torch.tensor([-(2.0 ** (-26 - fl)), -(2.0 ** (-25 - fl)), -0.1 * 2.0**-fl])
        theirs = qq.fixed_point_quantize(x, 8, fl, rounding="nearest")
        assert theirs.eq(0).all()
        assert torch.signbit(theirs).tolist() == [False, True, True]
        ours = compat.fixed_point_quantize(x, 8, fl, rounding="nearest")
        assert_same_bits(ours, torch.full_like(x, -0.0))


def test_qtorch_stochastic_fixed_point_turns_negatives_and_negative_zero_into_positive_zeros():
    # QPyTorch's "stochastic" computes nearbyint(-0.3 + r - 0.5) for -0.3 in FixedPoint(8, 0):
    # -1 for r < 0.3, -0.0 for 0.3 <= r < 0.8, and +0 for r >= 0.8 (2 draws in 10). lpsim's
    # zeros keep the sign.
    n = 1 << 16
    x = torch.full((n,), -0.3)
    theirs = qq.fixed_point_quantize(x, 8, 0, rounding="stochastic")
    positive = int(((theirs == 0) & ~torch.signbit(theirs)).sum())
    assert abs(positive - n * 0.2) <= 5 * math.sqrt(n * 0.2 * 0.8)
    ours = compat.fixed_point_quantize(x, 8, 0, rounding="stochastic", seed=0)
    assert int((ours == 0).sum()) > 0 and bool(torch.signbit(ours[ours == 0]).all())
    # -0.0 itself: nearbyint(r - 0.5) is +0 for r >= 0.5, half the draws.
    theirs = qq.fixed_point_quantize(torch.full((n,), -0.0), 8, 2, rounding="stochastic")
    assert abs(int((~torch.signbit(theirs)).sum()) - n / 2) <= 5 * math.sqrt(n / 4)
    ours = compat.fixed_point_quantize(torch.full((n,), -0.0), 8, 2, rounding="stochastic")
    assert_same_bits(ours, torch.full((n,), -0.0))


def test_qtorch_unclamped_fixed_point_overflows_to_inf_past_float32_and_lpsim_keeps_x():
    # x 2^fl beyond float32's largest value is Inf in QPyTorch's float32 arithmetic: the finite
    # inputs below, all on the grid of FixedPoint(8, 28, clamp=False), come back as +/-Inf.
    x = torch.tensor([3.4e38, 2.0**100, -(2.0**100), 1.0])
    theirs = qq.fixed_point_quantize(x, 8, 28, clamp=False, rounding="nearest")
    assert theirs.tolist() == [math.inf, math.inf, -math.inf, 1.0]
    assert_same_bits(compat.fixed_point_quantize(x, 8, 28, clamp=False, rounding="nearest"), x)
    # With fl >= 128 even 1.0 overflows; clamp=True clamps the Inf to the format's limit.
    theirs = qq.fixed_point_quantize(x[3:], 8, 130, clamp=False, rounding="nearest")
    assert theirs.tolist() == [math.inf]
    assert_same_bits(
        compat.fixed_point_quantize(x, 8, 28, clamp=True, rounding="nearest"),
        qq.fixed_point_quantize(x, 8, 28, clamp=True, rounding="nearest"),
    )

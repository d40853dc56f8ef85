"""The CPU loops' shortcuts for round to nearest and stochastic rounding (round_nearest_shortcut
and round_stochastic_shortcut in lpsim/round.h, and their forms for inputs where no special case
arises, lpsim/in_range.h) give round_to_grid's bits, compared in C++
(tests/cpp/round_shortcuts_check.cpp) under both rules (stochastic: a random word per input and
rbits 32, 1, 3, 8, 13 and 23 in turn) on every bfloat16 and float16 value, on every 251st float32
bit pattern and the values within 64 units of every power of two, and on random float64 values,
for 16 grids. (The check's ``all`` mode compares every one of the 2^32 float32 values, a few
minutes per grid; it is run by hand.) For formats where the shortcuts do not apply (no
subnormals, P3109's parity, Fixed) the loops keep round_to_grid; the quantize op equals the exact
reference either way."""

from __future__ import annotations

import math
import re
import subprocess

import pytest
import torch
from support import CXX, assert_same_bits, build_cpp_check

import lpsim
from lpsim import P3109, Fixed, Float
from lpsim import reference as ref

# name -> (format, whether every float32 value is compared: False in the test suite)
FORMATS = {
    "bfloat16": (Float(8, 7), False),
    "e4m3fn": (Float(4, 3, special="fn", saturate=True), False),
    "float16": (Float(5, 10), False),
    "e5m2": (Float(5, 2), False),
    "e5m2-saturating": (Float(5, 2, saturate=True), False),
    "e4m3-ieee": (Float(4, 3), False),
    "e3m2": (Float(3, 2, special="none", saturate=True), False),
    "e2m3": (Float(2, 3, special="none", saturate=True), False),
    "e2m1": (Float(2, 1, special="none", saturate=True), False),
    "e8m0-precision1": (Float(8, 0), False),
    "e8m22": (Float(8, 22), False),
    "e11m3-in-float64": (Float(11, 3), False),
    "e5m2fnuz": (Float(5, 2, special="fnuz"), False),
    "no-subnormals": (Float(5, 2, subnormals=False), False),
    "p3109-8p3": (P3109(8, 3), False),
    "fixed": (Fixed(8, 4), False),
}


def _argument(fmt) -> str:
    def text(v):
        return float(v).hex() if isinstance(v, float) else str(int(v))

    return ",".join(text(v) for v in fmt.grid())


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    if CXX is None:
        pytest.skip("needs a C++ compiler")
    return build_cpp_check(
        "round_shortcuts_check", tmp_path_factory.mktemp("cpp"), ("-std=c++20", "-O2", "-pthread")
    )


@pytest.fixture(scope="module")
def check_output(binary) -> str:
    arguments = []
    for fmt, every in FORMATS.values():
        arguments += [_argument(fmt), "all" if every else "sample"]
    run = subprocess.run([binary, *arguments], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-5000:]
    return run.stdout


def _report(output: str, fmt) -> dict[str, str]:
    """container -> "compared N" / "does not fit" / "shortcut does not apply" for one grid."""
    block = output.split(f"grid {_argument(fmt)}\n", 1)[1].split("grid ", 1)[0]
    return dict(re.findall(r"  (\w+): (.+)", block))


def test_shortcut_gives_round_to_grids_bits_on_every_value_compared(check_output):
    assert check_output.strip().endswith("\n0 failures"), check_output[-5000:]


def test_a_sample_of_every_binade_is_compared_in_float32(check_output):
    compared = re.findall(r"  float32: compared (\d+)", check_output)
    assert len(compared) == 12 and all(int(c) > 2 * 2**32 // 251 for c in compared), check_output


@pytest.mark.parametrize(
    "name", ["bfloat16", "float16", "e5m2", "e4m3-ieee", "e3m2", "e2m1", "e8m0-precision1", "e8m22"]
)
def test_shortcut_applies_to_float_formats_with_subnormals(check_output, name):
    report = _report(check_output, FORMATS[name][0])
    assert report["float32"].startswith("compared"), report
    assert report["float64"].startswith("compared"), report


def _in_range(report: dict[str, str]) -> dict[str, tuple[int, int]]:
    """container -> (inputs compared in lpsim/in_range.h's range, of which in its fixed part)."""
    counts = {}
    for container, text in report.items():
        found = re.search(r"in range (\d+), fixed (\d+)", text)
        if found:
            counts[container] = (int(found[1]), int(found[2]))
    return counts


@pytest.mark.parametrize(
    "name",
    ["bfloat16", "float16", "e5m2", "e4m3fn", "e2m1", "e8m22", "e5m2fnuz", "e11m3-in-float64"],
)
def test_the_in_range_forms_are_compared_where_they_apply(check_output, name):
    counts = _in_range(_report(check_output, FORMATS[name][0]))
    assert counts and all(fixed > 0 for _, fixed in counts.values()), counts


@pytest.mark.parametrize("name", ["float16", "e5m2", "e4m3fn", "e3m2"])
def test_the_variable_quantum_is_compared_in_the_grids_subnormal_binades(check_output, name):
    counts = _in_range(_report(check_output, FORMATS[name][0]))
    assert counts["float32"][0] > counts["float32"][1] > 0, counts


@pytest.mark.parametrize("name", ["bfloat16", "float16", "e5m2", "e4m3fn", "e2m1", "e5m2fnuz"])
def test_the_bounded_form_is_compared_beyond_the_grids_limits(check_output, name):
    # Finite inputs of the fixed range past the limit: the fixed quantum's rounding, then the
    # grid's overflow outcome (saturation, Inf or NaN).
    report = _report(check_output, FORMATS[name][0])
    beyond = {c: int(m[1]) for c, t in report.items() if (m := re.search(r"bounded (\d+)", t))}
    assert beyond and all(count > 0 for count in beyond.values()), report


def test_the_in_range_forms_need_a_kept_fraction_bit(check_output):
    counts = _in_range(_report(check_output, FORMATS["e8m0-precision1"][0]))
    assert counts["float32"] == (0, 0), counts


@pytest.mark.parametrize("name", ["bfloat16", "float16", "e4m3fn", "e5m2fnuz", "e2m1", "e8m22"])
@pytest.mark.parametrize("scale", [1.0, 1e-4])
def test_quantize_equals_the_reference_on_blocks_in_and_out_of_the_ranges(name, scale):
    # The CPU loop rounds blocks of 256 wholly in the fixed-quantum range by that form, blocks
    # reaching into the grid's subnormal binades by the variable one (scale 1e-4 puts float16's
    # there), others by the shortcut: blocks wholly in range, blocks with one input out of it (the
    # smallest subnormals, below them, above the limit, Inf, NaN, zeros of both signs), a partial
    # last block, a view from element 100, in place and not, both rules.
    fmt = FORMATS[name][0]
    g = torch.Generator().manual_seed(1)
    limit = fmt.grid().pos_limit
    base = (torch.randn(256 * 12 + 77, generator=g, dtype=torch.float64) * scale).clamp(
        -limit, limit
    )
    smallest = 2.0 ** fmt.grid().qmin
    outliers = [1e-30, -3e-8, 1e30, math.inf, -math.inf, math.nan, 0.0, -0.0, 1.5 * smallest]
    for i, v in enumerate(outliers):
        base[256 * (i + 2) + 17 * i] = v
    base[5] = 0.0
    base[6] = -0.0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        try:
            lpsim.formats.check_fits(fmt, dtype)
        except ValueError:
            continue
        for x in (base.to(dtype), base.to(dtype)[100:]):
            for rule in ("nearest", "stochastic"):
                seed = 3 if rule == "stochastic" else None
                want = ref.quantize(x, fmt, rule, seed=seed)
                assert_same_bits(lpsim.quantize(x, fmt, rule, seed=seed), want, f"{dtype} {rule}")
                y = x.clone()
                lpsim.quantize_(y, fmt, rule, seed=seed)
                assert_same_bits(y, want, f"{dtype} {rule} in place")


@pytest.mark.parametrize("name", ["no-subnormals", "p3109-8p3", "fixed"])
def test_shortcut_does_not_apply_without_subnormals_with_code_parity_or_fixed(check_output, name):
    report = _report(check_output, FORMATS[name][0])
    assert report["float32"] == "shortcut does not apply", report


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_equals_the_exact_reference_on_every_container(name):
    fmt = FORMATS[name][0]
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (4096,), generator=g).double()
    )
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        try:
            lpsim.formats.check_fits(fmt, dtype)
        except ValueError:
            continue
        x = wide.to(dtype)
        assert_same_bits(lpsim.quantize(x, fmt), ref.quantize(x, fmt, "nearest"), f"{dtype}")
        for rbits in (None, 5):
            got = lpsim.quantize(x, fmt, "stochastic", rbits=rbits, seed=7)
            want = ref.quantize(x, fmt, "stochastic", rbits=rbits, seed=7)
            assert_same_bits(got, want, f"{dtype} stochastic rbits {rbits}")


def test_block_grids_round_as_fixed_point_grids_and_take_the_shortcuts(binary):
    """BlockFloat's grids keep wl - 2 fraction bits (the top binade's precision) so that the
    shortcuts and forms apply; on every 16-bit value and every 4093rd float32 pattern, for widths
    3, 5 and 8 and block maxima from zero to the largest finite value, they round as the same grids
    with every container bit kept, and the shortcuts and forms agree with round_to_grid."""
    run = subprocess.run([binary, "blocks"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("\n0 failures"), run.stdout[-5000:]
    rows = re.findall(
        r"  (\w+) wl (\d+) max (\w+): keep (\d+), shortcut (\w+), compared \d+, "
        r"in range (\d+), fixed (\d+)",
        run.stdout,
    )
    assert len(rows) == 54, run.stdout
    for container, wl, peak, keep, shortcut, ranged, fixed in rows:
        assert int(keep) == int(wl) - 2
        normal = (
            int(peak, 16) >= {"float32": 1 << 23, "bfloat16": 1 << 7, "float16": 1 << 10}[container]
        )
        # A normal block maximum: the shortcuts apply and the forms are compared.
        assert (shortcut == "yes") == normal, (container, wl, peak)
        assert not normal or int(ranged) >= int(fixed) > 0, (container, wl, peak)

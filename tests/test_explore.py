"""lpsim.finfo and the format explorer (python -m lpsim.explore): facts against torch.finfo,
ml_dtypes.finfo and gfloat, and the command's table, plot and errors."""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import pytest
import torch

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float
from lpsim.explore import finfo, main, parse_format
from lpsim.scaled import preset as scaled_preset

TORCH_TWINS = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}
ML_DTYPES_TWINS = {
    "e2m1fn": ml_dtypes.float4_e2m1fn,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
# torch 2.14's finfo(float8_e5m2fnuz).eps is 0.125, though its own cast puts 1.25 after 1.0 (code
# 0x40 + 1): ml_dtypes' 0.25 is checked instead.
TORCH_EPS_WRONG = {"e5m2fnuz"}


@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_float_facts_equal_torch_finfo(name):
    ours, theirs = lpsim.finfo(lpsim.preset(name)), torch.finfo(TORCH_TWINS[name])
    assert (ours.bits, ours.max, ours.min) == (theirs.bits, theirs.max, theirs.min)
    assert (ours.tiny, ours.smallest_normal) == (theirs.tiny, theirs.smallest_normal)
    assert ours.resolution == theirs.resolution
    if name not in TORCH_EPS_WRONG:
        assert ours.eps == theirs.eps


@pytest.mark.parametrize("name", list(ML_DTYPES_TWINS))
def test_float_facts_equal_ml_dtypes_finfo(name):
    ours, theirs = finfo(lpsim.preset(name)), ml_dtypes.finfo(ML_DTYPES_TWINS[name])
    assert ours.bits == theirs.bits
    assert (ours.max, ours.min, ours.eps) == (
        float(theirs.max),
        float(theirs.min),
        float(theirs.eps),
    )
    assert ours.smallest_normal == float(theirs.smallest_normal)
    assert ours.smallest_subnormal == float(theirs.smallest_subnormal)
    # (ml_dtypes' resolution is 0.1 rounded into each 8-bit type, not numpy's 10**-precision.)


@pytest.mark.parametrize("precision", range(1, 8))
@pytest.mark.parametrize("signed", [True, False])
def test_p3109_facts_equal_gfloat(precision, signed):
    gfloat = pytest.importorskip("gfloat")
    from gfloat.formats import Domain, Signedness, format_info_p3109  # noqa: PLC0415

    fi = format_info_p3109(
        8, precision, Signedness.Signed if signed else Signedness.Unsigned, Domain.Finite
    )
    ours = finfo(P3109(8, precision, signed=signed, domain="finite"))
    assert (ours.max, ours.smallest_normal, ours.smallest_subnormal) == (
        fi.max,
        fi.smallest_normal,
        fi.smallest_subnormal,
    )
    assert ours.min == (-fi.max if signed else 0.0)
    assert ours.eps == fi.eps
    assert gfloat is not None


def test_fixed_facts_are_the_spacing_and_the_integer_limits():
    info = finfo(Fixed(8, 4))
    assert (info.max, info.min, info.eps, info.smallest_subnormal) == (
        127 / 16,
        -8.0,
        1 / 16,
        1 / 16,
    )
    assert info.binades == math.log2(127)
    unsigned = finfo(Fixed(6, 2, signed=False))
    assert (unsigned.max, unsigned.min) == (63 / 4, 0.0)


def test_block_and_scaled_facts_are_relative_to_their_scales():
    block = finfo(BlockFloat(8))
    assert (block.max, block.eps, block.note) == (127 / 64, 1 / 64, "one block, shared exponent 0")
    mx = finfo(scaled_preset("mxfp8_e4m3"))
    assert mx.max == 448 * 2.0**127 and mx.smallest_subnormal == 2.0**-9 * 2.0**-127
    assert mx.eps == 2.0**-3 and mx.bits == 8
    nv = finfo(scaled_preset("nvfp4"))
    assert (nv.max, nv.smallest_subnormal) == (6 * 448, 0.5 * 2.0**-6)
    assert "tensor scale 1" in nv.note


def test_binades_are_the_log_of_the_positive_range():
    info = finfo(Float(5, 2))
    assert info.binades == math.log2(57344 / 2.0**-16)


def test_non_formats_are_refused():
    with pytest.raises(TypeError, match="fmt must be a Float, Fixed, P3109, BlockFloat or Scaled"):
        finfo("e4m3")


def test_arguments_name_presets_or_constructor_calls():
    assert parse_format("e4m3fn") == lpsim.preset("e4m3fn")
    assert parse_format("nvfp4") == scaled_preset("nvfp4")
    assert parse_format("Float(4, 3, special='fn')") == Float(4, 3, special="fn")
    with pytest.raises(ValueError, match="neither a preset"):
        parse_format("e9m9")
    with pytest.raises(ValueError, match="cannot make a format"):
        parse_format("Float(40, 3)")
    with pytest.raises(ValueError, match="cannot make a format"):
        parse_format("__import__('os')")


def test_command_prints_the_facts_side_by_side_and_plots(tmp_path, capsys):
    path = tmp_path / "spacing.png"
    main(["e4m3fn", "Fixed(8, 4)", "mxfp4_e2m1", "--plot", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["e4m3fn", "Fixed(8,", "4)", "mxfp4_e2m1"]
    assert lines[1].split() == ["bits", "8", "8", "4"]
    assert lines[2].split()[:3] == ["max", "448", "7.9375"]
    assert path.stat().st_size > 10_000


def test_command_refuses_unknown_names():
    with pytest.raises(SystemExit):
        main(["e9m9"])


def test_module_runs_once_without_warnings():
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "lpsim.explore", "bfloat16"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines()[1].split() == ["bits", "16"]

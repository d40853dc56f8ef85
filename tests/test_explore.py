"""lpsim.finfo and the format explorer (python -m lpsim.explore): facts against torch.finfo,
ml_dtypes.finfo and gfloat, and the command's table, plot and errors."""

from __future__ import annotations

import math
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float
from lpsim.explore import finfo, main, parse_format, relative_spacing, table
from lpsim.scaled import SCALED_PRESETS, PowerOfTwo, Scaled
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
# Every format of ml_dtypes that lpsim has a preset for, and numpy's float32 and float16, which
# ml_dtypes.finfo hands on to numpy.finfo.
ML_DTYPES_TWINS = {
    "e2m1fn": ml_dtypes.float4_e2m1fn,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3": ml_dtypes.float8_e4m3,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float32": np.float32,
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
    """docs/formats.md: every fact but resolution equals ml_dtypes.finfo's. ml_dtypes stores
    resolution in the type itself: lpsim's rounded into it for the 16- and 32-bit types, 0.1
    rounded into it for the 8-bit ones, and lpsim's exactly for the 6- and 4-bit ones."""
    ours, dtype = finfo(lpsim.preset(name)), ML_DTYPES_TWINS[name]
    theirs = ml_dtypes.finfo(dtype)
    assert ours.bits == theirs.bits
    for fact in ("max", "min", "smallest_normal", "tiny", "smallest_subnormal", "eps"):
        assert getattr(ours, fact) == float(getattr(theirs, fact)), fact
    resolution = float(theirs.resolution)
    if ours.bits >= 16:
        assert resolution == float(np.array(ours.resolution).astype(dtype))
        assert resolution != ours.resolution  # rounded: 10**-k is no binary fraction
    elif ours.bits == 8:
        assert resolution == float(np.array(0.1).astype(dtype))
        assert resolution != ours.resolution
    else:
        assert resolution == ours.resolution


def test_the_8_bit_resolutions_are_those_the_docs_give():
    resolutions = {
        name: (lpsim.finfo(lpsim.preset(name)).resolution, float(ml_dtypes.finfo(d).resolution))
        for name, d in ML_DTYPES_TWINS.items()
        if lpsim.preset(name).bits == 8
    }
    assert resolutions == {
        "e3m4": (0.1, 0.09375),
        "e4m3": (1.0, 0.1015625),
        "e4m3fn": (1.0, 0.1015625),
        "e4m3fnuz": (1.0, 0.1015625),
        "e5m2": (1.0, 0.09375),
        "e5m2fnuz": (1.0, 0.09375),
    }
    assert float(ml_dtypes.finfo(ml_dtypes.bfloat16).resolution) == 0.010009765625


@pytest.mark.parametrize("bits", range(3, 17))
def test_p3109_facts_equal_gfloat(bits):
    gfloat = pytest.importorskip("gfloat")
    from gfloat.formats import Domain, Signedness, format_info_p3109  # noqa: PLC0415

    checked = 0
    for signed in (True, False):
        for domain in (Domain.Finite, Domain.Extended):
            for precision in range(1, bits + (0 if signed else 1)):
                try:
                    fmt = P3109(bits, precision, signed=signed, domain=domain.name.lower())
                except ValueError:  # wider than float64 (12 bits and more at precision 1)
                    continue
                signedness = Signedness.Signed if signed else Signedness.Unsigned
                fi = format_info_p3109(bits, precision, signedness, domain)
                ours = finfo(fmt)
                for fact in ("max", "min", "smallest_normal", "smallest_subnormal", "eps"):
                    assert getattr(ours, fact) == getattr(fi, fact), (fmt, fact)
                checked += 1
    assert checked > 0 and gfloat is not None


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


def test_scaled_facts_beyond_float64_are_refused_not_given_as_inf_and_0(capsys):
    """Float(11, 10) elements times E8M0's scales: max is about 2**1151 and the smallest
    subnormal 2**-1159, which no float64 holds. finfo gave max inf and smallest_subnormal 0 (and
    binades raised ZeroDivisionError); it refuses with a ValueError naming the fact, and the
    command with a usage error. Facts within float64 are the exact products."""
    wide = Scaled(Float(11, 10))
    with pytest.raises(ValueError, match=r"has max .* beyond the range of a float64"):
        finfo(wide)
    with pytest.raises(SystemExit):
        main(["Scaled(Float(11, 10))"])
    assert "beyond the range of a float64" in capsys.readouterr().err
    info = finfo(Scaled(Float(10, 3)))  # max (15/8) 2**511 2**127, subnormal 2**-513 2**-127
    assert info.max == math.ldexp(15 / 8, 638) and info.smallest_subnormal == 2.0**-640


def test_binades_are_the_log_of_the_positive_range():
    info = finfo(Float(5, 2))
    assert info.binades == math.log2(57344 / 2.0**-16)


@pytest.mark.parametrize(
    "fmt,binades",
    [
        (Float(11, 52), 2098.0),  # max / smallest_subnormal overflows float64
        (Float(10, 4), 511 + math.log2(31 / 16) + 514),  # (31/16) 2**511 over 2**-514
        (Float(11, 10), 1023 + math.log2(2 - 2**-10) + 1032),
        (Float(8, 23), 127 + math.log2(2 - 2**-23) + 149),
    ],
)
def test_binades_of_wide_formats_are_finite(fmt, binades):
    info = finfo(fmt)
    assert info.binades == pytest.approx(binades, rel=1e-15)
    quotient = Fraction(info.max) / Fraction(info.smallest_subnormal)  # exact, as Python ints
    exact = math.log2(quotient.numerator) - math.log2(quotient.denominator)
    assert info.binades == pytest.approx(exact, rel=1e-15)


def test_the_table_prints_powers_of_two_only_where_they_are_exact():
    formats = (Float(11, 52), Float(5, 52), Float(8, 52), Float(8, 23))
    lines = table(["a", "b", "c", "d"], [finfo(f) for f in formats]).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    # max is 2**1024 (1 - 2**-53), 2**16 (1 - 2**-53), 2**128 (1 - 2**-53), 2**128 (1 - 2**-24)
    assert rows["max"] == ["~1.79769e+308", "~65536", "~3.40282e+38", "~3.40282e+38"]
    assert rows["smallest_subnormal"] == ["2^-1074", "2^-66", "2^-178", "2^-149"]
    assert rows["eps"] == ["2^-52", "2^-52", "2^-52", "2^-23"]
    assert rows["binades"] == ["2098.0", "82.0", "306.0", "277.0"]


def test_non_formats_are_refused():
    with pytest.raises(TypeError, match="fmt must be a Float, Fixed, P3109, BlockFloat, Scaled or"):
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


@pytest.mark.parametrize("name", ["float32", "tf32", "Fixed(20, 4)"])
def test_command_refuses_to_plot_formats_too_wide_to_list_before_printing(name, tmp_path, capsys):
    path = tmp_path / "spacing.png"
    with pytest.raises(SystemExit):
        main(["e4m3fn", name, "--plot", str(path)])
    captured = capsys.readouterr()
    assert "at most 16 bits" in captured.err and name in captured.err
    assert captured.out == ""
    assert not path.exists()


def test_command_plots_every_preset_of_at_most_16_bits(tmp_path, capsys):
    names = [n for n, f in lpsim.PRESETS.items() if f.bits <= 16] + list(SCALED_PRESETS)
    for start in range(0, len(names), 8):  # a legend of at most 8 lines fits the figure
        path = tmp_path / f"spacing{start}.png"
        main([*names[start : start + 8], "--plot", str(path)])
        assert capsys.readouterr().out.splitlines()[-1] == f"wrote {path}"
        assert path.stat().st_size > 10_000


def test_command_reports_a_plot_path_it_cannot_write(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["e4m3fn", "--plot", str(tmp_path / "missing" / "spacing.png")])
    assert "cannot write the plot to" in capsys.readouterr().err


def test_command_writes_the_plot_at_exactly_the_path_it_reports(tmp_path, capsys):
    """A PATH without an extension is a PNG file at that very path (matplotlib alone would add
    ".png" to it while the command reported the path given), an extension names the file format
    in any case, and a directory is refused before anything is printed (matplotlib alone wrote
    a hidden file ".png" inside it)."""
    path = tmp_path / "spacing"
    main(["e4m3fn", "--plot", str(path)])
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "spacing.SVG"
    main(["e4m3fn", "--plot", str(svg)])
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {svg}"
    assert b"<svg" in svg.read_bytes()[:1000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spacing", "spacing.SVG"]
    with pytest.raises(SystemExit):
        main(["e4m3fn", "--plot", f"{tmp_path}/"])
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "is a directory" in captured.err
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spacing", "spacing.SVG"]


def test_command_refuses_a_plot_file_format_it_cannot_write_before_printing(tmp_path, capsys):
    """--plot spacing.txt raised matplotlib's ValueError, a traceback after the table; it is a
    usage error naming --plot and the extensions it writes."""
    path = tmp_path / "spacing.txt"
    with pytest.raises(SystemExit):
        main(["e4m3fn", "--plot", str(path)])
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "'txt'" in captured.err
    assert "png" in captured.err and "svg" in captured.err
    assert captured.out == ""
    assert not path.exists()


def test_command_without_matplotlib_refuses_to_plot_before_printing(tmp_path, capsys, monkeypatch):
    """matplotlib is not among lpsim's dependencies: without it --plot raised
    ModuleNotFoundError after the table; it is a usage error saying what to install."""
    for module in ("matplotlib", "matplotlib.backend_bases", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(SystemExit):
        main(["e4m3fn", "--plot", str(tmp_path / "spacing.png")])
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err
    assert captured.out == ""
    main(["e4m3fn"])  # the table itself needs no matplotlib
    assert capsys.readouterr().out.splitlines()[1].split() == ["bits", "8"]


def test_command_refuses_unknown_names():
    with pytest.raises(SystemExit):
        main(["e9m9"])


@pytest.mark.parametrize("module", ["lpsim.formats", "lpsim.explore"])
def test_module_runs_once_without_warnings(module):
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", module, "bfloat16", "e4m3fn"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stderr == ""
    assert result.stdout.splitlines()[1].split() == ["bits", "16", "8"]
    usage = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith(f"usage: python -m {module} ")


def test_power_of_two_scale_facts_are_torch_and_ml_dtypes_e8m0():
    # E8M0 holds 2**-127 .. 2**127 and nothing else: no zero, no sign, a doubling per step.
    info = finfo(PowerOfTwo(8))
    theirs = torch.finfo(torch.float8_e8m0fnu)
    ml = ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu)
    assert (info.bits, info.max, info.min, info.tiny, info.eps) == (
        theirs.bits,
        theirs.max,
        theirs.min,
        theirs.tiny,
        theirs.eps,
    )
    assert (info.smallest_subnormal, info.resolution) == (float(ml.smallest_subnormal), 1.0)
    assert info.binades == 254
    small = finfo(PowerOfTwo(4, bias=3))  # 2**-3 .. 2**11 (code 15 is NaN)
    assert (small.min, small.max, small.eps) == (2.0**-3, 2.0**11, 1.0)
    v, spacing = relative_spacing(PowerOfTwo(4, bias=3))
    assert v.tolist() == [2.0**k for k in range(-3, 11)] and bool((spacing == 1).all())


def test_command_prints_and_plots_a_power_of_two_scale(tmp_path, capsys):
    path = tmp_path / "spacing.png"
    main(["e4m3fn", "PowerOfTwo(8)", "--plot", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["bits", "8", "8"]
    assert path.stat().st_size > 0


@pytest.mark.parametrize("fmt", [lpsim.Fixed(8, -3), lpsim.Fixed(6, -6), lpsim.Fixed(8, 0)])
def test_resolution_of_coarse_formats_follows_numpys_definition(fmt):
    """numpy.finfo: precision = int(-log10(eps)), truncated toward zero, resolution =
    10**-precision: for eps = 8 (Fixed(8, -3)) that is 1, where a floor would give 10."""
    info = finfo(fmt)
    assert info.resolution == 10.0 ** -int(-np.log10(info.eps))
    assert finfo(lpsim.Fixed(8, -3)).resolution == 1.0


def test_help_describes_the_command_and_its_arguments(capsys):
    """--help printed the module docstring's first line, cut mid-sentence ("... for every format
    family, and a command"), and nothing about NAME_OR_FORMAT."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = " ".join(text.split("positional arguments:")[0].split("\n\n", 1)[1].split())
    assert description.endswith(".") and "--plot" in description
    arguments = " ".join(text.split("positional arguments:")[1].split())
    for words in ("lpsim.PRESETS", "SCALED_PRESETS", "constructor call", "P3109", "PowerOfTwo"):
        assert words in arguments, words


def _table_formats() -> list:
    """Every preset the table prints, and every P3109 format of 3 to 16 bits that lpsim holds."""
    formats = list(lpsim.PRESETS.values())
    for bits in range(3, 17):
        for signed in (True, False):
            for domain in ("extended", "finite"):
                for precision in range(1, bits + (0 if signed else 1)):
                    try:
                        formats.append(P3109(bits, precision, signed=signed, domain=domain))
                    except ValueError:  # wider than float64
                        continue
    return formats


def _rows(formats: list) -> dict[str, list[str]]:
    lines = table([str(k) for k in range(len(formats))], [finfo(f) for f in formats])
    return {line.split()[0]: line.split()[1:] for line in lines.splitlines()[1:]}


def test_every_number_the_table_prints_is_exact_or_marked_approximate():
    """A fact prints as 2^k (an exact power of two beyond 2^+-10), as its exact decimal (at most
    10 significant digits), or marked "~" with six significant digits. Unmarked six-digit
    roundings read as exact: e4m3fn's smallest_subnormal 2^-9 printed 0.00195312 (it is
    0.001953125), binary8p7sf's max 127/64 printed 1.98438 (1.984375), and Float(5, 52)'s max
    2^16 (1 - 2^-53) printed 65536."""
    formats = _table_formats()
    rows = _rows(formats)
    checked = 0
    for fact in ("max", "min", "smallest_normal", "smallest_subnormal", "eps"):
        for cell, fmt in zip(rows[fact], formats, strict=True):
            value = Fraction(getattr(finfo(fmt), fact))
            if cell.startswith("~"):  # only where the exact decimal is long
                assert len(Decimal(float(value)).as_tuple().digits) > 10, (fact, cell)
                assert float(cell[1:]) == float(f"{float(value):.6g}"), (fact, cell)
            elif cell.lstrip("-").startswith("2^"):
                sign = -1 if cell.startswith("-") else 1
                assert value == sign * Fraction(2) ** int(cell.lstrip("-")[2:]), (fact, cell)
            else:
                assert Fraction(cell) == value, (fact, cell, float(value))
            checked += 1
    assert checked == 5 * len(formats)
    rows = _rows([lpsim.preset("e4m3fn"), P3109(8, 7, domain="finite"), Float(5, 52)])
    assert rows["smallest_subnormal"] == ["0.001953125", "0.015625", "2^-66"]
    assert rows["max"] == ["448", "1.984375", "~65536"]
    assert rows["min"] == ["-448", "-1.984375", "~-65536"]


@pytest.mark.parametrize(
    "text",
    [
        "Float(4, 3, special=Float.__init__.__globals__['__builtins__'])",
        "Float(4, 3).__class__.__base__",
        "Fixed(8, (lambda: 4)())",
        "P3109(8, [c for c in ()])",
    ],
)
def test_parse_format_runs_nothing_but_the_format_constructors(text):
    # parse_format evaluated the text with the builtins removed, but attribute chains reach them
    # again (Float.__init__.__globals__): an argument could run any code. Only calls of the
    # format classes on literals are evaluated now.
    with pytest.raises(ValueError, match="is not allowed in a format|may be called"):
        parse_format(text)
    assert parse_format("Scaled(Float(2, 1), block=32)") == Scaled(Float(2, 1), block=32)

"""The format explorer: ``finfo(fmt)``, torch.finfo's facts for every format family, and a command
that prints them side by side and plots relative spacing over the range.

    python -m lpsim.formats NAME_OR_FORMAT... [--plot PATH]

A NAME is a preset of ``lpsim.PRESETS`` (e4m3fn, bfloat16, binary8p3se, ...) or of
``lpsim.scaled.SCALED_PRESETS`` (mxfp8_e4m3, nvfp4, ...); a FORMAT is a constructor call of the
format classes, such as ``"Float(4, 3, special='fn')"`` or ``"Fixed(8, 4)"`` (evaluated with those
classes and nothing else in scope).

``python -m lpsim.explore`` runs the same command. lpsim.formats is a package so that running it
(its __main__ module) does not execute the already imported lpsim.formats a second time.
"""

from __future__ import annotations

import argparse
import ast
import decimal
import math
import pathlib
from dataclasses import dataclass

import torch

from lpsim.formats import MAX_VALUES_BITS, P3109, PRESETS, BlockFloat, Fixed, Float
from lpsim.scaled import SCALED_PRESETS, PowerOfTwo, Scaled

__all__ = ["FormatInfo", "finfo", "parse_format", "main"]


@dataclass(frozen=True)
class FormatInfo:
    """A format's facts, with torch.finfo's names (real values as floats).

    Attributes:
        format: the format described.
        bits: bits per value (per element for BlockFloat and Scaled, the shared scale not counted).
        max: the largest finite value.
        min: the most negative finite value (0 for unsigned formats).
        smallest_normal: the smallest positive value with a full significand (Fixed: the spacing).
        tiny: smallest_normal, under torch.finfo's other name.
        smallest_subnormal: the smallest positive value.
        eps: the distance from 1 to the next larger value (Fixed: the spacing; BlockFloat and
            Scaled: the element's, relative to its block's scale). Where 1 is a subnormal value
            (Float(1, ...), or a bias that puts 1 below the smallest normal) this is the
            subnormal spacing; where no value follows 1 (1 lies outside the positive range, or
            is max) it is the spacing above 1 in a binade of normal values, 2**-man, which is
            what numpy's and torch's finfo call eps (see Float.eps).
        resolution: 10**-int(-log10(eps)), the decimal resolution as numpy and torch define it
            (int truncates toward zero: 1 for an eps between 1 and 10).
        binades: log2(max / smallest_subnormal), the positive range in powers of two (computed
            from the exponents and significands apart, so it stays finite where the quotient
            would overflow a float64).
        note: what the facts are relative to, where a block or a scale is involved ("" otherwise).
    """

    format: object
    bits: int
    max: float
    min: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    note: str = ""

    @property
    def tiny(self) -> float:
        return self.smallest_normal

    @property
    def resolution(self) -> float:
        return 10.0 ** -int(-math.log10(self.eps))

    @property
    def binades(self) -> float:
        # max / smallest_subnormal overflows float64 for wide formats (Float(11, 52): about
        # 2**1024 / 2**-1074): take the exponents apart, exactly, and divide the significands
        # only (exactly too where smallest_subnormal is a power of two, as in every format).
        m_max, e_max = math.frexp(self.max)
        m_min, e_min = math.frexp(self.smallest_subnormal)
        return math.log2(m_max / m_min) + (e_max - e_min)


def finfo(fmt: Float | Fixed | P3109 | BlockFloat | Scaled | PowerOfTwo) -> FormatInfo:
    """The facts of ``fmt``: a Float, Fixed, P3109, BlockFloat or Scaled format, or a PowerOfTwo
    scale format.

    BlockFloat facts are those of one block whose shared exponent is 0 (every block is these
    values times a power of two). Scaled facts span every block scale: max is the largest element
    times the largest scale, smallest_subnormal the smallest positive element times the smallest
    scale (the tensor scale taken as 1), eps the element's. A PowerOfTwo (E8M0 and its kin) holds
    the powers 2**emin to 2**emax and nothing else (no zero, no sign): min, smallest_normal and
    smallest_subnormal are all 2**emin and eps is 1, as torch.finfo(torch.float8_e8m0fnu) has them.

    Raises:
        TypeError: fmt is not one of these formats.
        ValueError: a Scaled format's fact lies beyond float64's range (a Float(11, ...) element
            times E8M0's largest scale 2**127 overflows it).
    """
    if isinstance(fmt, Float):
        return FormatInfo(
            fmt, fmt.bits, fmt.max, -fmt.max, fmt.smallest_normal, fmt.smallest_subnormal, fmt.eps
        )
    if isinstance(fmt, P3109):
        return FormatInfo(
            fmt, fmt.bits, fmt.max, fmt.min, fmt.smallest_normal, fmt.smallest_subnormal, fmt.eps
        )
    if isinstance(fmt, Fixed):
        return FormatInfo(fmt, fmt.bits, fmt.max, fmt.min, fmt.eps, fmt.eps, fmt.eps)
    if isinstance(fmt, BlockFloat):
        return FormatInfo(
            fmt,
            fmt.bits,
            fmt.max,
            -fmt.max,
            fmt.smallest_normal,
            fmt.smallest_subnormal,
            fmt.eps,
            "one block, shared exponent 0",
        )
    if isinstance(fmt, PowerOfTwo):
        least = fmt.smallest_normal
        return FormatInfo(fmt, fmt.bits, fmt.max, least, least, least, 1.0, "powers of two only")
    if isinstance(fmt, Scaled):
        element = finfo(fmt.element)
        scale = fmt.scale
        smallest_scale = scale.smallest_normal  # scales are clamped to the normal range
        largest_scale = scale.max
        note = "over every block scale" + (", tensor scale 1" if fmt.tensor_scale else "")
        facts = {
            "max": (element.max, largest_scale),
            "min": (element.min, largest_scale),
            "smallest_normal": (element.smallest_normal, smallest_scale),
            "smallest_subnormal": (element.smallest_subnormal, smallest_scale),
        }
        products = {name: a * b for name, (a, b) in facts.items()}
        for name, (a, b) in facts.items():
            if not math.isfinite(products[name]) or (products[name] == 0) != (a == 0):
                raise ValueError(
                    f"finfo: {fmt!r} has {name} {_number(a)} x {_number(b)}, beyond the range "
                    "of a float64 (the facts are Python floats)"
                )
        return FormatInfo(fmt, fmt.bits, *products.values(), element.eps, note)
    raise TypeError(
        "fmt must be a Float, Fixed, P3109, BlockFloat, Scaled or PowerOfTwo format, got "
        f"{type(fmt).__name__}"
    )


_CONSTRUCTORS = {
    "Float": Float,
    "Fixed": Fixed,
    "P3109": P3109,
    "BlockFloat": BlockFloat,
    "Scaled": Scaled,
    "PowerOfTwo": PowerOfTwo,
}


def parse_format(text: str) -> Float | Fixed | P3109 | BlockFloat | Scaled | PowerOfTwo:
    """The format a command-line argument names: a preset name, or a constructor call of the
    format classes.

    Raises:
        TypeError: text is not a str.
        ValueError: neither; the message lists where names come from.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if text in PRESETS:
        return PRESETS[text]
    if text in SCALED_PRESETS:
        return SCALED_PRESETS[text]
    if "(" in text:
        try:
            tree = ast.parse(text, mode="eval")
            _check_constructor_call(tree)
            fmt = eval(compile(tree, "<format>", "eval"), {"__builtins__": {}}, dict(_CONSTRUCTORS))  # noqa: S307
        except Exception as error:  # a malformed call: report it as the argument's problem
            raise ValueError(f"cannot make a format of {text!r}: {error}") from None
        if isinstance(fmt, tuple(_CONSTRUCTORS.values())):
            return fmt
        raise ValueError(f"{text!r} is not a format")
    raise ValueError(
        f"{text!r} is neither a preset (lpsim.PRESETS, lpsim.scaled.SCALED_PRESETS) nor a "
        "constructor call such as \"Float(4, 3, special='fn')\""
    )


_LITERAL_NODES = (
    ast.Expression,
    ast.Call,
    ast.keyword,
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.UnaryOp,
    ast.BinOp,
    ast.USub,
    ast.UAdd,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
    ast.Load,
)


def _check_constructor_call(tree: ast.Expression) -> None:
    """Raises ValueError unless ``tree`` holds only calls of the format classes by name, with
    literal numbers, strings, bools, None, tuples, lists and arithmetic on them: no attribute,
    subscript or other name, so that evaluating it runs nothing but the constructors."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _CONSTRUCTORS:
                raise ValueError(f"{node.id!r} is not one of {', '.join(_CONSTRUCTORS)}")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise ValueError("only the format classes may be called, by name")
        elif not isinstance(node, _LITERAL_NODES):
            raise ValueError(f"{type(node).__name__} is not allowed in a format")


def _number(v: float) -> str:
    """v as the table prints it, exactly where that is short: an exact power of two beyond 2^+-10
    as 2^k, else its exact decimal where that has at most 10 significant digits (0.001953125,
    1.984375), else "~" and six significant digits (~3.40282e+38). The power is read off
    frexp's significand, which is exactly 1/2 for powers of two only: a log2 that merely rounds
    to an integer, as that of Float(11, 52)'s max 2^1024 (1 - 2^-53) does, is not one."""
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return f"{v:.6g}"
    sign = "-" if v < 0 else ""
    significand, exponent = math.frexp(abs(v))
    if significand == 0.5 and abs(exponent - 1) > 10:
        return f"{sign}2^{exponent - 1}"
    exact = decimal.Decimal(abs(v))  # a float's decimal expansion, exactly
    if len(exact.as_tuple().digits) <= 10:
        return sign + format(exact, "f")
    return f"~{v:.6g}"


def table(names: list[str], infos: list[FormatInfo]) -> str:
    """The facts side by side: one column per format."""
    rows = [
        ("bits", [str(i.bits) for i in infos]),
        ("max", [_number(i.max) for i in infos]),
        ("min", [_number(i.min) for i in infos]),
        ("smallest_normal", [_number(i.smallest_normal) for i in infos]),
        ("smallest_subnormal", [_number(i.smallest_subnormal) for i in infos]),
        ("eps", [_number(i.eps) for i in infos]),
        # 10**-k by definition (the float only approximates it): printed as that power of ten.
        ("resolution", [f"{i.resolution:g}" for i in infos]),
        ("binades", [f"{i.binades:.1f}" for i in infos]),
    ]
    if any(i.note for i in infos):
        rows.append(("relative to", [i.note or "-" for i in infos]))
    first = max(len(r[0]) for r in rows)
    widths = [max(len(n), *(len(r[1][k]) for r in rows)) for k, n in enumerate(names)]
    lines = [" ".join([" " * first] + [n.rjust(w) for n, w in zip(names, widths, strict=True)])]
    for label, cells in rows:
        cells = [c.rjust(w) for c, w in zip(cells, widths, strict=True)]
        lines.append(" ".join([label.ljust(first), *cells]))
    return "\n".join(lines)


def relative_spacing(
    fmt: Float | Fixed | P3109 | BlockFloat | Scaled | PowerOfTwo,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, (next value - v) / v) for every positive value v of fmt but the largest (for a Scaled
    format, its element's values: the relative spacing is the same in every block).

    Raises:
        ValueError: the values listed have more than MAX_VALUES_BITS (16) bits.
    """
    if isinstance(fmt, PowerOfTwo):  # 2**emin, ..., 2**emax: each value doubles the one before
        powers = [math.ldexp(1.0, k) for k in range(fmt.emin, fmt.emax)]
        v = torch.tensor(powers, dtype=torch.float64)
        return v, torch.ones_like(v)
    values = _listed(fmt).values()
    positive = values[values > 0]
    return positive[:-1], (positive[1:] - positive[:-1]) / positive[:-1]


def _listed(fmt: Float | Fixed | P3109 | BlockFloat | Scaled) -> Float | Fixed | P3109 | BlockFloat:
    """The format whose values relative_spacing lists: a Scaled format's element, else fmt."""
    return fmt.element if isinstance(fmt, Scaled) else fmt


def _plot_format(path: str) -> str:
    """The file format the plot is written in at ``path``: the one its extension names (in lower
    case: "spacing.SVG" is an SVG file), PNG where it has none. The file is written at ``path``
    itself in either case (matplotlib alone adds ".png" to a path without an extension)."""
    suffix = pathlib.PurePath(path).suffix
    return suffix[1:].lower() if suffix else "png"


def _plot_path_problem(path: str) -> str | None:
    """Why the plot cannot be written at ``path`` (checked before anything is printed), or None:
    matplotlib is missing, PATH is a directory, or its extension names a file format that
    matplotlib does not write."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    if pathlib.Path(path).is_dir():
        return f"--plot PATH is a directory, not a file to write: {path!r}"
    kind = _plot_format(path)
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    if kind not in supported:
        return (
            f"--plot writes the file format that PATH's extension names, one of "
            f"{', '.join(supported)} (png where there is none); {path!r} names {kind!r}"
        )
    return None


def plot(names: list[str], formats: list, path: str) -> None:
    """Relative spacing against magnitude, log-log, one step line per format, written at ``path``
    in the file format _plot_format(path) names."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, fmt in zip(names, formats, strict=True):
        v, spacing = relative_spacing(fmt)
        ax.step(v.numpy(), spacing.numpy(), where="post", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("magnitude")
    ax.set_ylabel("relative spacing to the next value")
    ax.set_title("Relative spacing over each format's positive range")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=_plot_format(path))
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str = "python -m lpsim.explore") -> None:
    """The command: a table of the formats named in argv (sys.argv[1:] by default), and with
    --plot their relative spacing. ``prog`` is the command's name in its usage messages."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print the facts of number formats side by side, under torch.finfo's names "
        "(bits, max, min, smallest_normal, smallest_subnormal, eps, resolution) and binades, "
        "log2(max / smallest_subnormal); with --plot, also draw each format's relative spacing "
        "over its positive range.",
    )
    parser.add_argument(
        "formats",
        nargs="+",
        metavar="NAME_OR_FORMAT",
        help="a preset of lpsim.PRESETS or lpsim.scaled.SCALED_PRESETS (e4m3fn, binary8p4se, "
        "nvfp4, ...) or a constructor call of Float, Fixed, P3109, BlockFloat, Scaled or "
        "PowerOfTwo, such as \"Float(4, 3, special='fn')\"",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write the relative-spacing plot to this file, in the format its extension names "
        "(png, pdf, svg, ...; png where it has none)",
    )
    args = parser.parse_args(argv)
    try:
        formats = [parse_format(text) for text in args.formats]
    except ValueError as error:
        parser.error(str(error))
    wide = [
        n for n, f in zip(args.formats, formats, strict=True) if _listed(f).bits > MAX_VALUES_BITS
    ]
    if args.plot:
        problem = _plot_path_problem(args.plot)
        if problem:
            parser.error(problem)
    if args.plot and wide:
        parser.error(
            f"--plot lists every value of a format, so it draws formats of at most "
            f"{MAX_VALUES_BITS} bits (per element for scaled formats); too wide: {', '.join(wide)}"
        )
    try:
        infos = [finfo(f) for f in formats]
    except ValueError as error:
        parser.error(str(error))
    print(table(args.formats, infos))
    if args.plot:
        try:
            plot(args.formats, formats, args.plot)
        except OSError as error:
            parser.error(f"cannot write the plot to {args.plot!r}: {error.strerror}")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

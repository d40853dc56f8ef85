"""What each format and rounding rule does to standard-normal data, and how fast.

    python benchmarks/formats_survey.py [--size 1048576] [--formats e5m2,bfloat16,...]

For every preset Float format (and a few Fixed and BlockFloat formats) and every rounding rule it
quantises one float32 tensor of N(0, 1) samples and prints:
  rel. error   ||q(x) - x|| / ||x|| over the elements that stay finite
  unchanged    the share of elements returned unchanged (already in the format)
  non-finite   the share that became Inf or NaN (overflow in formats that do not saturate)
  M elem/s     throughput of lpsim.quantize on this machine (median of 5 runs)
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
from bench_options import at_least

import lpsim
from lpsim import BlockFloat, Fixed, Rounding
from lpsim.formats import PRESETS, check_fits

EXTRA_FORMATS = {
    "fixed<8,5>": Fixed(8, 5),
    "fixed<16,12>": Fixed(16, 12),
    "block8": BlockFloat(8),
    "block8 size32": BlockFloat(8, block_size=32),
}


def _throughput(x: torch.Tensor, fmt, rule: Rounding) -> float:
    out = torch.empty_like(x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        lpsim.quantize(x, fmt, rule, seed=0, out=out)
        times.append(time.perf_counter() - start)
    return x.numel() / statistics.median(times) / 1e6


def rows(size: int, names: list[str] | None = None):
    """(format name, rule, relative error, unchanged share, non-finite share, M elements/s)."""
    torch.manual_seed(0)
    x = torch.randn(size)
    formats = {**PRESETS, **EXTRA_FORMATS}
    for name, fmt in formats.items():
        if names and name not in names:
            continue
        check_fits(fmt, x.dtype)
        for rule in Rounding:
            y = lpsim.quantize(x, fmt, rule, seed=1)
            finite = torch.isfinite(y)
            error = ((y - x)[finite].norm() / x[finite].norm()).item()
            unchanged = (y == x).double().mean().item()
            yield (
                name,
                rule.name,
                error,
                unchanged,
                1.0 - finite.double().mean().item(),
                _throughput(x, fmt, rule),
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Rounding error and speed of every format and rule."
    )
    parser.add_argument(
        "--size", type=at_least(1), default=1 << 20, help="elements (default 2**20)"
    )
    parser.add_argument(
        "--formats", type=str, default=None, help="comma-separated names (default: all)"
    )
    args = parser.parse_args(argv)
    # Commas inside <...> belong to a name ("fixed<8,5>").
    names = re.split(r",(?![^<]*>)", args.formats) if args.formats else None
    known = {**PRESETS, **EXTRA_FORMATS}
    unknown = [name for name in names or () if name not in known]
    if unknown:
        parser.error(f"--formats: unknown {', '.join(unknown)}; the formats: {', '.join(known)}")
    print(
        f"lpsim {lpsim.__version__}: {args.size} standard-normal float32 values, "
        f"{torch.get_num_threads()} threads, CPU generator {lpsim.cpu_generator()}"
    )
    print(
        f"{'format':16s} {'rounding':17s} {'rel. error':>11s} {'unchanged':>10s} "
        f"{'non-finite':>11s} {'M elem/s':>9s}"
    )
    last = None
    for name, rule, error, unchanged, nonfinite, speed in rows(args.size, names):
        if last is not None and name != last:
            print()
        last = name
        print(
            f"{name:16s} {rule:17s} {error:11.3e} {unchanged:9.1%} {nonfinite:10.2%} {speed:9.0f}"
        )


if __name__ == "__main__":
    main()

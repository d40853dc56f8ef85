"""The cost of rounding statistics: quantize with statistics against quantize alone.

    python benchmarks/bench_statistics.py [--size 16777216] [--repeat 7] [--threads N]
                                          [--device cpu|cuda] [--quick]

For a float32 tensor of --size elements (default 2^24), each row times, alternately with its
reference and as medians of --repeat runs:

- ``quantize_with_statistics(x, fmt, rule)`` against ``quantize(x, fmt, rule)``: the overhead of
  the statistics when they are taken inside the rounding (the target is 1.3x at most);
- ``rounding_statistics(x, y, fmt)`` alone, a pass over x and its rounded value, against
  ``x.clone()``.

Formats: Float(5, 2) (e5m2), Float(4, 3) and Fixed(8, 4); rules nearest and stochastic. With
--device cuda the times are CUDA-event medians (the statistics include the copy of the chunks'
sums to the host). --quick: a smoke test's defaults (QUICK_SIZE elements, one repetition);
--size and --repeat given beside it are kept.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_options import at_least  # noqa: E402
from bench_quantize import cuda_alternating_medians_ms, median_ratio  # noqa: E402

import lpsim  # noqa: E402
from lpsim import Fixed, Float, quantize  # noqa: E402
from lpsim.statistics import quantize_with_statistics, rounding_statistics  # noqa: E402

FORMATS = {"e5m2": Float(5, 2), "e4m3": Float(4, 3), "fixed(8,4)": Fixed(8, 4)}
RULES = ("nearest", "stochastic")
QUICK_SIZE = 3 * 2**14 + 5  # three tasks of 16384 elements and a few more


def timed(fn, reference, repeat: int, device: str) -> tuple[float, float]:
    """(fn, reference) median times in milliseconds, the two timed alternately."""
    if device == "cuda":
        ours, ref = cuda_alternating_medians_ms([fn, reference], repeat)
        return ours, ref
    ours, ref = median_ratio(fn, reference, repeat)
    return 1e3 * ours, 1e3 * ref


def rows(size: int, repeat: int, device: str) -> list[dict]:
    x = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    for name, fmt in FORMATS.items():
        for rule in RULES:
            fused, alone = timed(
                lambda f=fmt, r=rule: quantize_with_statistics(x, f, r),
                lambda f=fmt, r=rule: quantize(x, f, r),
                repeat,
                device,
            )
            y = quantize(x, fmt, rule)
            separate, clone = timed(
                lambda f=fmt, y=y: rounding_statistics(x, y, f), x.clone, repeat, device
            )
            out.append(
                {
                    "format": name,
                    "rule": rule,
                    "quantize_ms": alone,
                    "with_statistics_ms": fused,
                    "overhead": fused / alone,
                    "statistics_ms": separate,
                    "clone_ms": clone,
                }
            )
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| format | rule | quantize (ms) | with statistics (ms) | ratio | statistics pass (ms) "
        "| clone (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['format']} | {r['rule']} | {r['quantize_ms']:.2f} | "
            f"{r['with_statistics_ms']:.2f} | {r['overhead']:.2f}x | {r['statistics_ms']:.2f} | "
            f"{r['clone_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=at_least(1), default=None, help="default 2**24")
    parser.add_argument("--repeat", type=at_least(1), default=None, help="default 7")
    parser.add_argument("--threads", type=at_least(1), default=None, help="default: torch's")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--quick", action="store_true", help=f"defaults {QUICK_SIZE} elements, one repetition"
    )
    args = parser.parse_args(argv)
    # --quick changes the defaults only: values given are kept.
    if args.size is None:
        args.size = QUICK_SIZE if args.quick else 2**24
    if args.repeat is None:
        args.repeat = 1 if args.quick else 7
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not (torch.cuda.is_available() and lpsim.cuda_built()):
        parser.error("--device cuda: no CUDA device, or lpsim built without its CUDA kernels")
    results = rows(args.size, args.repeat, args.device)
    print(
        f"rounding statistics, {args.size} float32 elements on {args.device}"
        + (f", {torch.get_num_threads()} threads" if args.device == "cpu" else "")
        + f", medians of {args.repeat}"
    )
    print(table(results))
    overheads = [r["overhead"] for r in results]
    print(f"median overhead of the statistics: {statistics.median(overheads):.2f}x (target 1.3x)")
    return results


if __name__ == "__main__":
    main()

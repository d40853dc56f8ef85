"""What fusing the rounding into the producing kernel saves: the time of a compiled
``quantize(x * 2 + 1, Float(5, 2))`` with the fusable form (lpsim.fusable.compiled_quantize, one
Inductor kernel) and with the custom op (Inductor's kernel for x * 2 + 1, then the C++ kernel), and
of ``x * 2 + 1`` compiled alone, on one thread; medians of --repeat runs, in milliseconds, and the
ratio of each to x * 2 + 1 alone.

    python benchmarks/bench_fusable.py [--sizes 1048576,16777216] [--repeat 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_options import at_least, counts

import lpsim
from lpsim import Float
from lpsim.fusable import compiled_quantize

FORMAT = Float(5, 2)
_NO_SEED = torch.zeros((), dtype=torch.int64)


def producer(x):
    return x * 2 + 1


def fused(x):
    return compiled_quantize(x * 2 + 1, FORMAT, "nearest")


def custom_op(x):
    return torch.ops.lpsim.quantize_grid(x * 2 + 1, *FORMAT.grid(), 0, 32, _NO_SEED, 0)


def custom_op_stochastic(x):
    return lpsim.quantize(x * 2 + 1, FORMAT, "stochastic", seed=1)


def eager(x):
    return lpsim.quantize(x * 2 + 1, FORMAT, "nearest")


def _median_ms(fn, x, repeat: int) -> float:
    fn(x)  # compile, warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=counts, default=[2**20, 2**24])
    parser.add_argument("--repeat", type=at_least(1), default=9)
    parser.add_argument("--threads", type=at_least(1), default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [
        ("x * 2 + 1 compiled alone", torch.compile(producer, fullgraph=True)),
        ("fusable quantize, compiled", torch.compile(fused, fullgraph=True)),
        ("custom op nearest, compiled", torch.compile(custom_op, fullgraph=True)),
        ("custom op stochastic, compiled", torch.compile(custom_op_stochastic, fullgraph=True)),
        ("custom op nearest, eager", eager),
    ]
    rows = []
    for size in args.sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(0))
        base = None
        for label, fn in cases:
            ms = _median_ms(fn, x, args.repeat)
            base = base or ms
            rows.append({"case": label, "size": size, "ms": ms, "ratio": ms / base})
    print(f"threads={args.threads}, median of {args.repeat}, float32, Float(5, 2)")
    print(f"{'case':34} {'elements':>10} {'ms':>9} {'x alone':>8}")
    for r in rows:
        print(f"{r['case']:34} {r['size']:>10} {r['ms']:>9.3f} {r['ratio']:>8.2f}")
    return rows


if __name__ == "__main__":
    main()

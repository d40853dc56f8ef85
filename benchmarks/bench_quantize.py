"""Throughput of lpsim's quantisation against references measured in the same run.

    python benchmarks/bench_quantize.py [--size 16777216] [--repeat 15] [--threads N]

CPU section: every op on a float32 tensor of --size elements, as the median time and its ratio to
``x.clone()`` (the memory-speed floor of an out-of-place op: one read, one allocation, one write).
Each op is timed alternately with clone, so every ratio compares medians taken over the same
stretch of time and drifts in machine load cancel. When qtorch (QPyTorch 0.3.0) is installed, its
time for the same call is another column, with its own interleaved clone; its formats differ in
details (see docs/migrating-from-qtorch.md) but the work is the same. torch's own casts are
listed as further references.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lpsim
from lpsim import BlockFloat, Fixed, Float


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_ratio(fn, reference, repeat: int) -> tuple[float, float]:
    """(median time of fn, median time of reference) in seconds, the two timed alternately after
    one warm-up call each."""
    fn()
    reference()
    ours, ref = [], []
    for _ in range(repeat):
        ours.append(_seconds(fn))
        ref.append(_seconds(reference))
    return statistics.median(ours), statistics.median(ref)


def load_qtorch():
    try:
        import qtorch.quant as qq  # noqa: PLC0415 - optional, slow (JIT-compiles on import)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None
    return qq


def cpu_cases(qq):
    """(name, lpsim call, qtorch call or None)."""
    cases = []
    for rule in ("nearest", "stochastic"):
        cases.append((
            f"float e5m2 {rule}",
            lambda x, r=rule: lpsim.quantize(x, Float(5, 2), r, seed=1),
            (lambda x, r=rule: qq.float_quantize(x, exp=5, man=2, rounding=r)) if qq else None,
        ))
        cases.append((
            f"float bfloat16 {rule}",
            lambda x, r=rule: lpsim.quantize(x, Float(8, 7), r, seed=1),
            (lambda x, r=rule: qq.float_quantize(x, exp=8, man=7, rounding=r)) if qq else None,
        ))
        cases.append((
            f"fixed <8,4> {rule}",
            lambda x, r=rule: lpsim.quantize(x, Fixed(8, 4), r, seed=1),
            (lambda x, r=rule: qq.fixed_point_quantize(x, wl=8, fl=4, rounding=r)) if qq else None,
        ))
        cases.append((
            f"block 8 tensor {rule}",
            lambda x, r=rule: lpsim.quantize(x, BlockFloat(8), r, seed=1),
            (lambda x, r=rule: qq.block_quantize(x, wl=8, dim=-1, rounding=r)) if qq else None,
        ))
        cases.append((
            f"block 8 dim=0 {rule}",
            lambda x, r=rule: lpsim.quantize(x.view(4096, -1), BlockFloat(8, 0), r, seed=1),
            (lambda x, r=rule: qq.block_quantize(x.view(4096, -1), wl=8, dim=0, rounding=r))
            if qq else None,
        ))
        cases.append((
            f"block 8 size=32 {rule}",
            lambda x, r=rule: lpsim.quantize(x, BlockFloat(8, block_size=32), r, seed=1),
            None,
        ))
    return cases


def run_cpu(size: int, repeat: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(size)
    qq = load_qtorch()
    clone = lambda: x.clone()  # noqa: E731
    print(f"CPU: {size} float32 elements, {torch.get_num_threads()} threads, "
          f"generator {lpsim.cpu_generator()}, medians of {repeat}, each op timed alternately "
          "with x.clone()")
    for name, fn in (("x.to(bfloat16).float()", lambda: x.to(torch.bfloat16).float()),
                     ("x.to(float8_e5m2).float()", lambda: x.to(torch.float8_e5m2).float())):
        t, c = median_ratio(fn, clone, repeat)
        print(f"{name}: {t * 1e3:.2f} ms, clone {c * 1e3:.2f} ms ({t / c:.2f}x)")
    print()
    header = f"{'op':28s} {'lpsim ms':>9s} {'clone ms':>9s} {'/clone':>7s}"
    if qq:
        header += f" {'qtorch ms':>10s} {'/clone':>7s} {'qtorch/lpsim':>13s}"
    print(header)
    print("-" * len(header))
    for name, ours, theirs in cpu_cases(qq):
        t, c = median_ratio(lambda: ours(x), clone, repeat)
        row = f"{name:28s} {t * 1e3:9.2f} {c * 1e3:9.2f} {t / c:6.2f}x"
        if qq:
            if theirs is None:
                row += f" {'-':>10s} {'-':>7s} {'-':>13s}"
            else:
                q, qc = median_ratio(lambda: theirs(x), clone, max(3, repeat // 3))
                row += f" {q * 1e3:10.2f} {q / qc:6.2f}x {q / qc / (t / c):12.1f}x"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2**24)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_cpu(args.size, args.repeat)


if __name__ == "__main__":
    main()

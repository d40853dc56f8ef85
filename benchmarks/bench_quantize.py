"""Throughput of lpsim's quantisation against references measured in the same run.

    python benchmarks/bench_quantize.py [--size 16777216] [--repeat 15] [--threads N]
                                        [--gpu-size 268435456] [--gpu-repeat 50] [--no-cpu]

--size and --gpu-size are multiples of 4096: the "block 8 dim=0" rows view x as 4096 rows.

CPU section: every op on a float32 tensor of --size elements, as the median time and its ratio to
``x.clone()`` (the memory-speed floor of an out-of-place op: one read, one allocation, one write).
Each op is timed alternately with clone, so every ratio compares medians taken over the same
stretch of time and drifts in machine load cancel. When qtorch (QPyTorch 0.3.0) is installed, its
time for the same call is another column, with its own interleaved clone; its formats differ in
details (see docs/migrating-from-qtorch.md) but the work is the same. torch's own casts are
listed as further references.

GPU section (when CUDA is available and lpsim was built with its CUDA kernels): every op on
--gpu-size float32 elements (2^28 by default) written into a preallocated output, timed with CUDA
events (median of --gpu-repeat runs after warm-up), as effective bandwidth (bytes read plus bytes
written, counting each input and output once, over time) and as a fraction of a device-to-device
copy of the same tensor measured in the same run; qtorch's CUDA kernels beside it when installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_options import at_least  # benchmarks/ is on sys.path as a script and in tests

import lpsim
from lpsim import BlockFloat, Fixed, Float

# The "block 8 dim=0" rows view x as ROWS rows, so the sizes are multiples of it.
ROWS = 4096


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
        cases.append(
            (
                f"float e5m2 {rule}",
                lambda x, r=rule: lpsim.quantize(x, Float(5, 2), r, seed=1),
                (lambda x, r=rule: qq.float_quantize(x, exp=5, man=2, rounding=r)) if qq else None,
            )
        )
        cases.append(
            (
                f"float bfloat16 {rule}",
                lambda x, r=rule: lpsim.quantize(x, Float(8, 7), r, seed=1),
                (lambda x, r=rule: qq.float_quantize(x, exp=8, man=7, rounding=r)) if qq else None,
            )
        )
        cases.append(
            (
                f"fixed <8,4> {rule}",
                lambda x, r=rule: lpsim.quantize(x, Fixed(8, 4), r, seed=1),
                (lambda x, r=rule: qq.fixed_point_quantize(x, wl=8, fl=4, rounding=r))
                if qq
                else None,
            )
        )
        cases.append(
            (
                f"block 8 tensor {rule}",
                lambda x, r=rule: lpsim.quantize(x, BlockFloat(8), r, seed=1),
                (lambda x, r=rule: qq.block_quantize(x, wl=8, dim=-1, rounding=r)) if qq else None,
            )
        )
        cases.append(
            (
                f"block 8 dim=0 {rule}",
                lambda x, r=rule: lpsim.quantize(x.view(ROWS, -1), BlockFloat(8, 0), r, seed=1),
                (lambda x, r=rule: qq.block_quantize(x.view(ROWS, -1), wl=8, dim=0, rounding=r))
                if qq
                else None,
            )
        )
        cases.append(
            (
                f"block 8 size=32 {rule}",
                lambda x, r=rule: lpsim.quantize(x, BlockFloat(8, block_size=32), r, seed=1),
                None,
            )
        )
    return cases


def run_cpu(size: int, repeat: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(size)
    qq = load_qtorch()
    clone = lambda: x.clone()  # noqa: E731
    print(
        f"CPU: {size} float32 elements, {torch.get_num_threads()} threads, "
        f"generator {lpsim.cpu_generator()}, medians of {repeat}, each op timed alternately "
        "with x.clone()"
    )
    for name, fn in (
        ("x.to(bfloat16).float()", lambda: x.to(torch.bfloat16).float()),
        ("x.to(float8_e5m2).float()", lambda: x.to(torch.float8_e5m2).float()),
    ):
        t, c = median_ratio(fn, clone, repeat)
        print(f"{name}: {t * 1e3:.2f} ms, clone {c * 1e3:.2f} ms ({t / c:.2f}x)")
    print()
    header = f"{'op':28s} {'lpsim ms':>9s} {'clone ms':>9s} {'/clone':>7s}"
    if qq:
        header += f" {'qtorch ms':>10s} {'/clone':>7s} {'qtorch/lpsim':>13s}"
    print(header)
    print("-" * len(header))
    for name, ours, theirs in cpu_cases(qq):
        t, c = median_ratio(lambda ours=ours: ours(x), clone, repeat)
        row = f"{name:28s} {t * 1e3:9.2f} {c * 1e3:9.2f} {t / c:6.2f}x"
        if qq:
            if theirs is None:
                row += f" {'-':>10s} {'-':>7s} {'-':>13s}"
            else:
                q, qc = median_ratio(lambda theirs=theirs: theirs(x), clone, max(3, repeat // 3))
                row += f" {q * 1e3:10.2f} {q / qc:6.2f}x {q / qc / (t / c):12.1f}x"
        print(row)


def cuda_median_ms(fn, repeat: int) -> float:
    """Median time of fn() in milliseconds, each run between two CUDA events, after warm-up."""
    return cuda_alternating_medians_ms([fn], repeat)[0]


def cuda_alternating_medians_ms(fns, repeat: int) -> list[float]:
    """Median time of each of fns in milliseconds, the functions run in turn within each of
    ``repeat`` rounds (so that drifts in the device's clocks or load reach all of them alike),
    each run between two CUDA events, after three warm-up rounds."""
    for _ in range(3):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, timed in zip(fns, times):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            timed.append(start.elapsed_time(stop))
    return [statistics.median(timed) for timed in times]


def gpu_cases(qq):
    """(name, lpsim call writing into out, qtorch call or None); x has 2^k elements."""
    cases = []
    for rule in ("nearest", "stochastic"):
        for label, fmt, theirs in (
            ("float e5m2", Float(5, 2), lambda x, r: qq.float_quantize(x, 5, 2, rounding=r)),
            ("float bfloat16", Float(8, 7), lambda x, r: qq.float_quantize(x, 8, 7, rounding=r)),
            ("fixed <8,4>", Fixed(8, 4), lambda x, r: qq.fixed_point_quantize(x, 8, 4, rounding=r)),
            ("block 8 tensor", BlockFloat(8), lambda x, r: qq.block_quantize(x, 8, -1, rounding=r)),
            ("block 8 size=32", BlockFloat(8, block_size=32), None),
        ):
            cases.append(
                (
                    f"{label} {rule}",
                    lambda x, out, f=fmt, r=rule: lpsim.quantize(x, f, r, seed=1, out=out),
                    (lambda x, t=theirs, r=rule: t(x, r)) if (qq and theirs) else None,
                )
            )
        cases.append(
            (
                f"block 8 dim=0 {rule}",
                lambda x, out, r=rule: lpsim.quantize(
                    x.view(ROWS, -1), BlockFloat(8, 0), r, seed=1, out=out.view(ROWS, -1)
                ),
                (lambda x, r=rule: qq.block_quantize(x.view(ROWS, -1), 8, 0, rounding=r))
                if qq
                else None,
            )
        )
    return cases


def run_gpu(size: int, repeat: int) -> None:
    x = torch.randn(size, device="cuda")
    out = torch.empty_like(x)
    qq = load_qtorch()
    bytes_moved = 2 * x.numel() * x.element_size()  # one read, one write
    copy_ms = cuda_median_ms(lambda: out.copy_(x), repeat)
    copy_gbs = bytes_moved / copy_ms / 1e6
    print(
        f"GPU: {torch.cuda.get_device_name()}, {size} float32 elements, CUDA events, "
        f"medians of {repeat}"
    )
    print(f"device-to-device copy: {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s (the 100% reference)")
    header = f"{'op':28s} {'lpsim ms':>9s} {'GB/s':>7s} {'of copy':>8s}"
    if qq:
        header += f" {'qtorch ms':>10s} {'GB/s':>7s} {'of copy':>8s} {'qtorch/lpsim':>13s}"
    print(header)
    print("-" * len(header))
    for name, ours, theirs in gpu_cases(qq):
        t = cuda_median_ms(lambda ours=ours: ours(x, out), repeat)
        row = f"{name:28s} {t:9.3f} {bytes_moved / t / 1e6:7.0f} {copy_ms / t:7.0%}"
        if qq:
            if theirs is None:
                row += f" {'-':>10s} {'-':>7s} {'-':>8s} {'-':>13s}"
            else:
                q = cuda_median_ms(lambda theirs=theirs: theirs(x), max(5, repeat // 5))
                row += f" {q:10.3f} {bytes_moved / q / 1e6:7.0f} {copy_ms / q:7.0%} {q / t:12.1f}x"
        print(row)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = at_least(ROWS, multiple_of=ROWS)
    parser.add_argument("--size", type=size, default=2**24, help=f"a multiple of {ROWS}")
    parser.add_argument("--repeat", type=at_least(1), default=15)
    parser.add_argument("--threads", type=at_least(1), default=None, help="default: torch's")
    parser.add_argument("--gpu-size", type=size, default=2**28, help=f"a multiple of {ROWS}")
    parser.add_argument("--gpu-repeat", type=at_least(1), default=50)
    parser.add_argument("--no-cpu", action="store_true", help="run the GPU section only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and lpsim.cuda_built()
    if args.no_cpu and not cuda:
        parser.error("--no-cpu: no CUDA device, or lpsim built without its CUDA kernels")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.no_cpu:
        run_cpu(args.size, args.repeat)
    if cuda:
        print()
        run_gpu(args.gpu_size, args.gpu_repeat)
    else:
        print("\nGPU section skipped: no CUDA device, or lpsim built without its CUDA kernels.")


if __name__ == "__main__":
    main()

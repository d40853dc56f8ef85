"""Per-call cost of lpsim's entry points on small tensors, against torch's own cheapest ops.

    python benchmarks/bench_overhead.py [--sizes 64,4096,1048576] [--repeat 15] [--quick]
                                        [--no-qtorch]

On one thread (torch.set_num_threads(1)), for float32 tensors of each size, every op is timed
timeit-style: a batch of calls long enough to measure (about --batch-ms milliseconds), divided by
the number of calls. Each op's batch alternates with a batch of ``x.to(torch.bfloat16)`` and one
of ``x.clone()``, the references, and each printed ratio compares medians of --repeat batches
taken over the same stretch of time, so drifts in machine load cancel. At 64 elements the time is
the per-call overhead (argument checks, dispatch, allocation); at 2^20 it is mostly the kernel.

The ops: quantize into Float(5, 2) by "nearest" and by "stochastic"; quantize_; an
lpsim.nn.Quantizer's forward and backward (and, as its reference, the forward and backward of
``x * 1.0``: the cost of a round trip through autograd's engine); sr_add_ of a float32 update into
a bfloat16 tensor; the forward of an nn.Linear with input, weight and output quantised by
lpsim.nn.inject (a Linear of 64 features on size / 64 rows; the plain Linear's forward is printed
beside it). QPyTorch's
``float_quantize(x, 5, 2, "nearest")`` is timed too when qtorch imports (its first import compiles
its extension, about 17 s).

--quick runs tiny sizes with short batches and few repeats, without qtorch: a smoke test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import torch
from bench_options import at_least, counts, positive_float
from torch import nn

import lpsim
from lpsim import Float
from lpsim.nn import LayerQuantization, Quantizer, inject

FORMAT = Float(5, 2)
FEATURES = 64  # of the benchmarked nn.Linear


def load_qtorch():
    """qtorch.quant, or None when it does not import; its build warnings and log are silenced."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import qtorch.quant as qq  # noqa: PLC0415 - optional, slow (compiles on first import)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None
    return qq


def cases(x: torch.Tensor, qq) -> list[tuple[str, object]]:
    """(name, call taking no argument) on the float32 tensor x, the references' x, which no call
    changes: quantize_ rounds a copy of it in place, so the calls timed after it (QPyTorch's)
    see x's own values."""
    size = x.numel()
    inplace = x.clone()
    grad_x = x.clone().requires_grad_()
    grad = torch.randn(size)
    quantizer = Quantizer(forward=FORMAT, backward=FORMAT)
    a = x.to(torch.bfloat16)
    update = torch.randn(size) * 1e-3
    rows = max(size // FEATURES, 1)
    features = FEATURES if size >= FEATURES else size
    inputs = torch.randn(rows, features)
    plain = nn.Linear(features, features)
    injected = inject(
        nn.Linear(features, features),
        {"default": LayerQuantization(weight=FORMAT, input=FORMAT, output=FORMAT)},
    )

    def quantizer_step():
        torch.autograd.backward(quantizer(grad_x), grad)

    def multiply_step():  # the same autograd round trip through a native op
        torch.autograd.backward(grad_x * 1.0, grad)

    found = [
        ("quantize nearest", lambda: lpsim.quantize(x, FORMAT, "nearest")),
        ("quantize stochastic", lambda: lpsim.quantize(x, FORMAT, "stochastic")),
        ("quantize_ nearest", lambda: lpsim.quantize_(inplace, FORMAT, "nearest")),
        ("Quantizer forward+backward", quantizer_step),
        ("x * 1.0 forward+backward", multiply_step),
        ("sr_add_ bfloat16", lambda: lpsim.sr_add_(a, update)),
        ("injected Linear forward", lambda: injected(inputs)),
        ("plain Linear forward", lambda: plain(inputs)),
    ]
    if qq is not None:
        found.append(
            ("qtorch float_quantize nearest", lambda: qq.float_quantize(x, 5, 2, "nearest"))
        )
    return found


def calls_per_batch(fn, batch_seconds: float) -> int:
    """How many calls of fn take about batch_seconds (at least one)."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= batch_seconds / 4 or calls >= 1 << 20:
            return max(1, round(calls * batch_seconds / max(elapsed, 1e-9)))
        calls *= 4


def per_call(fn, calls: int) -> float:
    """Seconds per call of one batch of ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(fn, references, repeat: int, batch_seconds: float) -> list[float]:
    """Median seconds per call of fn and of each reference, batches timed alternately."""
    timed = [fn, *references]
    counts = [calls_per_batch(f, batch_seconds) for f in timed]
    samples = [[] for _ in timed]
    for _ in range(repeat):
        for f, calls, sample in zip(timed, counts, samples):
            sample.append(per_call(f, calls))
    return [statistics.median(sample) for sample in samples]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=counts, default=None, help="comma-separated element counts")
    parser.add_argument("--repeat", type=at_least(1), default=None, help="batches per op (median)")
    parser.add_argument("--batch-ms", type=positive_float, default=None, help="length of one batch")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, short, no qtorch")
    parser.add_argument("--no-qtorch", action="store_true", help="skip QPyTorch")
    args = parser.parse_args(argv)
    # --quick changes the defaults only: values given are kept.
    if args.sizes is None:
        args.sizes = [64, 256] if args.quick else [64, 4096, 2**20]
    if args.repeat is None:
        args.repeat = 3 if args.quick else 15
    if args.batch_ms is None:
        args.batch_ms = 1.0 if args.quick else 20.0
    sizes, repeat, batch_seconds = args.sizes, args.repeat, args.batch_ms / 1000
    qq = None if args.quick or args.no_qtorch else load_qtorch()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    results: list[dict] = []
    references: dict[int, tuple[float, float]] = {}
    for size in sizes:
        x = torch.randn(size)
        to_bf16, clone = (lambda x=x: x.to(torch.bfloat16)), (lambda x=x: x.clone())
        bf16_all, clone_all = [], []
        for name, fn in cases(x, qq):
            ours, bf16, copy = measure(fn, (to_bf16, clone), repeat, batch_seconds)
            bf16_all.append(bf16)
            clone_all.append(copy)
            results.append(
                {
                    "op": name,
                    "size": size,
                    "us": ours * 1e6,
                    "bf16": ours / bf16,
                    "clone": ours / copy,
                }
            )
        references[size] = statistics.median(bf16_all), statistics.median(clone_all)

    print(f"torch {torch.__version__}, 1 thread, float32, medians of {repeat} batches")
    header = f"{'op':32s}" + "".join(
        f" | {f'{s} us':>10s} {'/bf16':>7s} {'/clone':>7s}" for s in sizes
    )
    print(header)
    print("-" * len(header))
    for name in dict.fromkeys(r["op"] for r in results):
        line = f"{name:32s}"
        for size in sizes:
            row = next(r for r in results if r["op"] == name and r["size"] == size)
            line += f" | {row['us']:10.2f} {row['bf16']:6.2f}x {row['clone']:6.2f}x"
        print(line)
    for label, index in (("x.to(torch.bfloat16)", 0), ("x.clone()", 1)):
        line = f"{label:32s}"
        for size in sizes:
            line += f" | {references[size][index] * 1e6:10.2f} {'':7s} {'':7s}"
        print(line)
    return results


if __name__ == "__main__":
    main()

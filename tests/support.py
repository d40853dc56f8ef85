"""Helpers shared by the tests: bit-exact comparison and structured test inputs."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import torch

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, context: str = "") -> None:
    """got and want have the same dtype, shape and bits, except that any NaN matches any NaN.
    Signed zeros are told apart. The message shows the first differing elements."""
    assert got.dtype == want.dtype, f"{context}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{context}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got_c, want_c = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    nan_got, nan_want = torch.isnan(got_c), torch.isnan(want_c)
    view = _INT_VIEW[got.dtype]
    same = (got_c.view(view) == want_c.view(view)) | (nan_got & nan_want)
    if not bool(same.all()):
        bad = (~same).flatten().nonzero().flatten()[:8].tolist()
        g, w = got_c.flatten(), want_c.flatten()
        rows = ", ".join(f"[{i}] got {g[i].item()!r} want {w[i].item()!r}" for i in bad)
        raise AssertionError(f"{context}: {int((~same).sum())} elements differ: {rows}")


def assert_same_for_any_thread_count(compute, threads: int) -> None:
    """compute() gives the same bits with ``threads`` threads as with one (torch's thread count is
    restored afterwards)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = compute()
        torch.set_num_threads(threads)
        assert_same_bits(compute(), want, f"{threads} threads")
    finally:
        torch.set_num_threads(before)


def next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, math.inf))


def next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def specials(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=dtype)


def neighbourhood(
    values: torch.Tensor, dtype: torch.dtype = torch.float32, beyond: float | None = None
) -> torch.Tensor:
    """Inputs that exercise every rounding decision of a format whose finite values (ascending,
    float64) are ``values``: each value, the midpoint of each pair of neighbours, and the container
    values just below and above each midpoint and each value; then the region past the largest
    value up to ``beyond`` (default: three largest spacings past it), and +/-0, +/-Inf, NaN.
    Everything is rounded into the container ``dtype`` first, so ties are exact ties whenever the
    container holds them."""
    v = values.to(torch.float64)
    mids = (v[1:] + v[:-1]) / 2
    top = v[-1].item()
    step = (v[-1] - v[-2]).item()
    far = beyond if beyond is not None else top + 3 * step
    tail = torch.linspace(top, far, 16, dtype=torch.float64)
    points = torch.cat([v, mids, tail, -tail]).to(dtype)
    around = torch.cat([points, next_up(points), next_down(points)])
    return torch.cat([around, specials(dtype)])


ROOT = pathlib.Path(__file__).resolve().parent.parent
CXX = shutil.which("c++") or shutil.which("g++")  # None: the C++ checks are skipped


def build_cpp_check(name: str, directory: pathlib.Path, flags: tuple[str, ...] = ()) -> str:
    """Compile tests/cpp/NAME.cpp against lpsim's headers (csrc/include and csrc) with warnings as
    errors, into ``directory``; returns the binary's path. ``flags``: the standard, optimisation
    and other flags of that check."""
    binary = directory / name
    subprocess.run(
        [
            CXX,
            *flags,
            "-Wall",
            "-Werror",
            f"-I{ROOT / 'csrc' / 'include'}",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tests" / "cpp" / f"{name}.cpp"),
            "-o",
            str(binary),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return str(binary)


def tensors_equal(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, compared bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def without_times(rows: list[dict]) -> list[dict]:
    """A training log's rows without their wall-time columns (those ending in "seconds")."""
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]


def run_two_gloo_processes(module: str, args: list[str]) -> str:
    """python -m torch.distributed.run with 2 CPU processes (one thread each) running
    ``python -m module *args`` from the repository's root; returns its standard output.

    Raises:
        AssertionError: the run failed (its output's tails are the message).
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        module,
        *args,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def shares_backpropagate_the_whole_batch(whole_loss, share_loss, logits, targets, world_size):
    """Check a trainer's loss under torchrun: with the batch (logits, targets) split by rows into
    world_size equal shares, the gradient of share_loss(share, its targets, world_size)[0] with
    respect to each share is, bit for bit, the share's rows of the gradient of
    whole_loss(logits, targets), one process's loss on the whole batch. Returns share_loss's
    second result for each share, in order."""
    whole = logits.clone().requires_grad_()
    whole_loss(whole, targets).backward()
    size = logits.shape[0] // world_size
    seconds = []
    for rank in range(world_size):
        rows = slice(rank * size, (rank + 1) * size)
        share = logits[rows].clone().requires_grad_()
        loss, second = share_loss(share, targets[rows], world_size)
        loss.backward()
        assert_same_bits(share.grad, whole.grad[rows], f"the gradient of share {rank}")
        seconds.append(second)
    return seconds


def power_of_two_exponent(amax: float, fmt, work) -> int:
    """The exponent e of the scale 2**e that lpsim.scaled's documented rules give a block whose
    largest magnitude is ``amax`` (finite), clamped to the scale's exponent range; ``work`` is the
    arithmetic (numpy float32, or float64 for float64 tensors) of the "rceil" division. emax is
    floor(log2(elem_max)); an all-zero block has the smallest scale."""
    element_max = fmt.element.max
    emax = math.frexp(element_max)[1] - 1
    if amax == 0:
        return fmt.scale.emin

    def ceil_log2(v: float) -> int:
        significand, exponent = math.frexp(v)  # v = significand * 2**exponent, in [0.5, 1)
        return exponent - 1 if significand == 0.5 else exponent

    if fmt.scale_rule == "floor":
        e = math.frexp(amax)[1] - 1 - emax
    elif fmt.scale_rule == "ceil":
        e = ceil_log2(amax) - emax
    elif fmt.scale_rule == "even":
        # amax rounded to the element's precision (fraction bits of its largest binade) with
        # ties away from zero: a significand that rounds up to 2 moves into the next binade
        element = fmt.element  # a Fixed element: fl fraction bits, emax more in the binade
        bits = element.fl + emax if hasattr(element, "fl") else element.man
        significand, exponent = math.frexp(amax)
        rounded = math.floor(2 * significand * 2**bits + 0.5) / 2**bits
        e = exponent - 1 + (rounded >= 2) - emax
    else:
        assert fmt.scale_rule == "rceil"
        quotient = float(work(amax) / work(element_max))  # rounded in the arithmetic
        e = ceil_log2(quotient) if quotient > 0 else fmt.scale.emin  # log2(0) = -inf
    return min(max(e, fmt.scale.emin), fmt.scale.emax)


def scaled_bounds_model(x: torch.Tensor, fmt) -> list[tuple[float, float, float]]:
    """(low, high, smallest_normal) of each element of x (row-major) rounded into the Scaled
    ``fmt``, whose blocks run along one axis (blocks of n, whole rows along ``axis``, or the whole
    tensor) with a power-of-two scale under any of its rules, or a float32 or E4M3 scale under
    "amax": from lpsim.scaled's documented encoding, each block's scale from its largest
    magnitude, and its range the decoded values of the element format's limits (and its smallest
    normal value), in float32 arithmetic (float64 for float64 x), rounded into x's dtype; with a
    Float scale, extended to the largest x of x's dtype whose product with the encoder's
    reciprocal (1 / t, then divided by the scale) is still within the element's limits (nothing
    saturated)."""
    from lpsim import Float  # noqa: PLC0415

    assert not isinstance(fmt.block, tuple)
    if fmt.axis != -1 and fmt.block != "tensor" and x.dim() > 1:
        # The blocks along axis are those along the last axis of x with axis moved there.
        moved = x.movedim(fmt.axis, -1)
        at_end = scaled_bounds_model(moved, dataclasses.replace(fmt, axis=-1))
        order = torch.arange(x.numel()).reshape(x.shape).movedim(fmt.axis, -1).flatten()
        bounds = [None] * x.numel()
        for k, i in enumerate(order.tolist()):
            bounds[i] = at_end[k]
        return bounds
    work = np.float64 if x.dtype == torch.float64 else np.float32
    values = x.double().reshape(-1).numpy()
    if fmt.block == "tensor" or x.dim() == 0 or not len(values):
        rows = values.reshape(1, -1)
    else:
        rows = values.reshape(-1, x.shape[-1])
    length = rows.shape[1] if fmt.block in (None, "tensor") else fmt.block
    element = fmt.element
    low_element = element.max if isinstance(element, Float) else -element.min
    smallest_normal = element.smallest_normal if isinstance(element, Float) else 0.0
    tensor_finite = bool(np.isfinite(values).all())
    t = work(1)
    if fmt.tensor_scale and tensor_finite and len(values):
        top = work(fmt.scale.max) * work(element.max)
        t = max(work(np.abs(values).max()) / top, work(2.0**-126 / fmt.scale.smallest_normal))

    def into_x(v) -> float:
        return torch.tensor(float(v), dtype=torch.float64).to(x.dtype).item()

    def largest_within(start: float, limit: float, reciprocal) -> float:
        """The largest value of x's dtype from start up whose product with reciprocal (in the
        arithmetic) is at most limit."""
        v, up = torch.tensor(start, dtype=x.dtype), torch.tensor(math.inf, dtype=x.dtype)
        while True:
            step = torch.nextafter(v, up)
            if not math.isfinite(float(step)) or work(float(step)) * reciprocal > work(limit):
                return float(v)
            v = step

    bounds = []
    for row in rows:
        for start in range(0, len(row), max(length, 1)):
            block = row[start : start + length]
            if not np.isfinite(block).all() or (fmt.tensor_scale and not tensor_finite):
                bounds += [(-math.inf, math.inf, 0.0)] * len(block)
                continue
            amax = float(np.abs(block).max())
            if fmt.scale_rule != "amax":
                factor = work(2.0 ** power_of_two_exponent(amax, fmt, work))
            else:
                d = (work(amax) / work(element.max)) / t
                d = min(max(d, work(fmt.scale.smallest_normal)), work(fmt.scale.max))
                if fmt.scale == Float(8, 23):  # float32 scales: d rounded to float32
                    scale = work(np.float32(d))
                else:
                    assert fmt.scale == Float(4, 3, special="fn", saturate=True)
                    scale = np.float32(d).astype(ml_dtypes.float8_e4m3fn).astype(work)
                factor = t * scale
            decode = [into_x(work(q) * factor) for q in (low_element, element.max, smallest_normal)]
            if fmt.scale_rule == "amax":
                reciprocal = (work(1) / t) / scale
                decode[0] = largest_within(decode[0], low_element, reciprocal)
                decode[1] = largest_within(decode[1], element.max, reciprocal)
            bounds += [(-decode[0], decode[1], decode[2])] * len(block)
    return bounds


def block_float_bounds_model(x: torch.Tensor, fmt) -> list[tuple[float, float, float]]:
    """(low, high, smallest_normal) of each element of x (row-major) rounded into the BlockFloat
    ``fmt``, from its documented encoding: a block (the whole tensor, an index along dim, or
    block_size consecutive elements along the last dimension) has the exponent e of its largest
    finite magnitude, floor(log2), raised so that the spacing 2^(e - (wl-2)) is no finer than
    x's dtype's smallest subnormal; its range is +/-(2^(wl-1) - 1) times that spacing."""
    smallest_subnormal_exponent = {
        torch.float32: -149,
        torch.float64: -1074,
        torch.bfloat16: -133,
        torch.float16: -24,
    }[x.dtype]
    values = x.double()
    if x.dim() == 0:
        values = values.reshape(1)
    if values.numel() == 0:
        return []
    index = torch.arange(values.numel()).reshape(values.shape)
    if fmt.block_size is not None:
        rows, n = values.reshape(-1, values.shape[-1]), fmt.block_size
        groups = [
            row[start : start + n]
            for row in index.reshape(rows.shape)
            for start in range(0, rows.shape[1], n)
        ]
    elif fmt.dim is not None:
        groups = list(index.movedim(fmt.dim, 0).reshape(values.shape[fmt.dim], -1))
    else:
        groups = [index.reshape(-1)]
    flat = values.reshape(-1).tolist()
    bounds: list = [None] * len(flat)
    for group in groups:
        members = group.tolist()
        finite = [abs(flat[i]) for i in members if math.isfinite(flat[i])]
        largest = max(finite, default=0.0)
        e = math.frexp(largest)[1] - 1 if largest else -math.inf
        q = max(e - (fmt.wl - 2), smallest_subnormal_exponent)
        limit = (2 ** (fmt.wl - 1) - 1) * 2.0**q
        for i in members:
            bounds[i] = (-limit, limit, 0.0)
    return bounds

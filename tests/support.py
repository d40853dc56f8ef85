"""Helpers shared by the tests: bit-exact comparison and structured test inputs."""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import subprocess
import sys

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

"""Everything that needs CUDA, in one command: build lpsim's CUDA kernels for the GPU at hand, run
every GPU test, compare torch's CUDA arithmetic with lpsim's model of it, run the GPU sections of
the benchmarks, and write one markdown report.

    python3 tools/gpu_check.py [--out DIR] [--quick] [--steps build,tests,probe,bench]
                               [--benchmarks quantize,scaled,statistics,training,mac]
                               [--time-limit SECONDS]          (or: make gpu-check)

It uses the Python it runs under (on a GPU machine without a package registry, its own python3
with torch) and installs nothing. The report, report.md, and the full logs (build.log, tests.log,
bench.log) go to --out, or to $LPSIM_GPU_CHECK_OUT, else $OUT, else out/gpu-check. Test
dependencies that are missing are listed in the report (docs/performance.md says how to bring them
as wheels); tests that need them skip or fail, and the report shows which.

Steps and their time limits: the whole check gets --time-limit seconds (default 540, to fit a
10-minute device call with the machine's start); the build at most 300 of them (94-109 s for sm_90
on 16 cores), and what the build leaves is split between the tests (40% to the CUDA test files, 20%
to the device-parametrised tests of the others; 65% and 30% without the benchmarks), a comparison of
torch's CUDA arithmetic with lpsim's model of it (at most 60 s) and the benchmarks (the rest, each
benchmark its share, SHARES; --benchmarks picks some). Everything takes more than one call: run
--steps build,tests,probe in one and --steps bench --no-build in another on the machine that still
holds the build (--no-build is --steps without build), or --steps build,bench on a fresh one.
--quick shortens the benchmarks, not their limits. A step that runs past its
limit is stopped and reported; the steps after it still run. With pytest-xdist the tests run in up
to 8 processes. Without a CUDA device (or without torch's CUDA), the report says so and everything
that needs one is skipped: the command then takes seconds and exits 0, which is how CI runs it
(tests/test_gpu_check.py).

Exit status: 0 when every step that ran succeeded (or was skipped for want of a GPU), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What the tests import beyond torch, and what happens without it.
TEST_DEPENDENCIES = {
    "pytest": "no test runs",
    "hypothesis": "the property tests fail to import",
    "ml_dtypes": "the cast comparisons against ml_dtypes fail to import",
    "numpy": "most tests fail to import",
    "gfloat": "the P3109 and MX comparisons against gfloat fail to import",
    "torchao": "the MX and NVFP4 comparisons against torchao fail to import",
    "scipy": "the Hadamard comparison against scipy fails",
    "sklearn": "the demo's data (digits) is missing",
    "matplotlib": "the plots of the demo and experiments fail",
    "qtorch": "QPyTorch comparisons are skipped (qtorch needs a JIT build)",
}

# The GPU tests: the files that exist for CUDA, and the device-parametrised tests of the others.
GPU_TEST_FILES = [
    "tests/test_cuda.py",
    "tests/test_sr_add_cuda.py",
    "tests/test_mac_cuda.py",
    "tests/test_fused_optim_cuda.py",
    "tests/test_gpu_index_math.py",
    "tests/test_tensor_core_hardware.py",
]
DEVICE_TESTS = [
    "tests/test_transforms.py",
    "tests/test_cifar10.py",
    "tests/test_op_devices.py",
    "tests/test_gpt.py",
]
DEVICE_SELECTION = "cuda or gpu or tensor_core_recipes_need_the_cpu"

# The steps, in their order (--steps picks some: a long build can leave the benchmarks to a second
# device call).
STEPS = ("build", "tests", "probe", "bench")

# The benchmarks (--benchmarks names them), their titles in the report, and their shares of the
# benchmark step's time.
BENCHMARK_TITLES = {
    "quantize": "quantize",
    "scaled": "scaled formats",
    "statistics": "rounding statistics",
    "training": "training",
    "mac": "simulated GEMM",
}
SHARES = {"quantize": 2, "scaled": 2, "statistics": 1, "training": 4, "mac": 3}


def _run(command: list[str], log: pathlib.Path, timeout: float, env=None) -> tuple[int, float]:
    """(exit status, seconds) of command, its output written to log; status 124 on timeout."""
    start = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        try:
            status = subprocess.run(
                command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[stopped after {timeout:.0f} s]\n")
            status = 124
    return status, time.monotonic() - start


def _tail(log: pathlib.Path, lines: int) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:])


def _environment() -> tuple[list[str], object]:
    """Lines describing the machine, and torch (None when it does not import)."""
    lines = [f"- Python {platform.python_version()} ({sys.executable}), {platform.machine()}"]
    try:
        import torch  # noqa: PLC0415
    except ImportError as error:
        lines.append(f"- torch does not import: {error}")
        return lines, None
    lines.append(f"- torch {torch.__version__}, built with CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"- GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} multiprocessors"
            )
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release [^\n]*", version)
        lines.append(f"- nvcc {nvcc}: {release.group(0) if release else 'version unknown'}")
    else:
        lines.append("- nvcc not found")
    lines.append(f"- {os.cpu_count()} CPU cores")
    return lines, torch


def _missing_dependencies() -> list[str]:
    return [
        f"- `{name}` missing: {effect}"
        for name, effect in TEST_DEPENDENCIES.items()
        if importlib.util.find_spec(name) is None
    ]


def _pytest_summary(text: str) -> str:
    """pytest's last summary line ("3 failed, 200 passed, 4 skipped in 12.3s") in text."""
    found = re.findall(r"^=*\s*(\d+ \w+.* in [\d.]+s.*?)\s*=*$", text, re.M)
    return found[-1] if found else "no summary (see tests.log)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="where the report goes")
    parser.add_argument("--quick", action="store_true", help="fewer tests and shorter benchmarks")
    parser.add_argument("--no-build", action="store_true", help="use the extension as built")
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"the steps to run, comma-separated, of {','.join(STEPS)} (default: all)",
    )
    parser.add_argument(
        "--benchmarks",
        default=",".join(SHARES),
        help=f"the benchmarks of the bench step, comma-separated, of {','.join(SHARES)} "
        "(default: all)",
    )
    parser.add_argument("--time-limit", type=float, default=540, help="seconds for everything")
    args = parser.parse_args(argv)
    steps = set(args.steps.split(","))
    if not steps <= set(STEPS):
        parser.error(f"--steps takes some of {','.join(STEPS)}, got {args.steps!r}")
    chosen = args.benchmarks.split(",")
    if not set(chosen) <= set(SHARES):
        parser.error(f"--benchmarks takes some of {','.join(SHARES)}, got {args.benchmarks!r}")
    if args.no_build:
        steps.discard("build")
    deadline = time.monotonic() + args.time_limit
    out = args.out or pathlib.Path(
        os.environ.get("LPSIM_GPU_CHECK_OUT") or os.environ.get("OUT") or ROOT / "out/gpu-check"
    )
    out.mkdir(parents=True, exist_ok=True)
    logs = {name: out / f"{name}.log" for name in ("build", "tests", "bench")}
    for log in logs.values():
        log.write_text("")
    report = ["# lpsim GPU check", "", "## Machine", ""]
    environment, torch = _environment()
    report += environment
    missing = _missing_dependencies()
    report += ["", "## Test dependencies", ""] + (missing or ["- all present"])
    failed = False

    has_gpu = torch is not None and torch.version.cuda is not None and torch.cuda.is_available()
    if not has_gpu:
        report += [
            "",
            "## Skipped",
            "",
            "No CUDA device (or torch without CUDA): the CUDA build, the GPU tests and the GPU "
            "benchmarks were skipped.",
        ]
        (out / "report.md").write_text("\n".join(report) + "\n")
        print("\n".join(report))
        return 0

    # 1. Build for this GPU's architecture.
    report += ["", "## Build", ""]
    if "build" not in steps:
        report.append("- skipped: the extension as it was built")
    else:
        p = torch.cuda.get_device_properties(0)
        env = dict(os.environ)
        env.setdefault("TORCH_CUDA_ARCH_LIST", f"{p.major}.{p.minor}")
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        env["LPSIM_CUDA"] = "1"
        command = [sys.executable, "setup.py", "build_ext", "--inplace"]
        status, seconds = _run(command, logs["build"], min(300, args.time_limit / 2), env)
        report.append(
            f"- `{' '.join(command)}` for sm_{p.major}{p.minor}: "
            f"{'ok' if status == 0 else f'FAILED (status {status})'} in {seconds:.0f} s"
        )
        if status != 0:
            report += ["", "```", _tail(logs["build"], 40), "```"]
            (out / "report.md").write_text("\n".join(report) + "\n")
            print("\n".join(report))
            return 1
    imported = subprocess.run(
        [sys.executable, "-c", "import lpsim; print(lpsim.cuda_built())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    built = imported.stdout.strip() == "True"
    report.append(f"- lpsim imports with its CUDA kernels: {built}")
    if not built:
        report += ["", "```", (imported.stdout + imported.stderr)[-3000:], "```"]
        failed = True

    # 2. The GPU tests: the CUDA test files whole, the device-parametrised tests of the others.
    if "tests" in steps:
        failed |= _tests(report, logs["tests"], deadline, with_bench="bench" in steps)
    # 3. torch's own CUDA arithmetic, which FusedSGD and FusedAdam reproduce (lpsim/optim_step.h).
    if "probe" in steps:
        failed |= _probe(report, logs["bench"])
    # 4. The GPU sections of the benchmarks.
    if "bench" in steps:
        failed |= _benchmarks(report, logs["bench"], deadline, args.quick, chosen)
    (out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 1 if failed else 0


def _tests(report: list[str], log: pathlib.Path, deadline: float, with_bench: bool) -> bool:
    """Runs the GPU tests within their share of the time left; True if one failed."""
    report += ["", "## Tests", ""]
    pytest = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        # pytest-xdist: the tests in several processes, each with its own CUDA context.
        pytest += ["-n", str(min(8, os.cpu_count() or 1))]
    left = max(deadline - time.monotonic(), 60)
    shares = (0.4, 0.2) if with_bench else (0.65, 0.3)
    runs = ((GPU_TEST_FILES, [], shares[0]), (DEVICE_TESTS, ["-k", DEVICE_SELECTION], shares[1]))
    failed = False
    for files, selection, share in runs:
        before = log.stat().st_size
        status, seconds = _run([*pytest, *selection, *files], log, left * share)
        text = log.read_text(errors="replace")[before:]
        report.append(
            f"- `pytest {' '.join(selection + files)}`: {_pytest_summary(text)} ({seconds:.0f} s)"
        )
        if status not in (0, 5):  # 5: nothing selected
            failed = True
            failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
            report += ["", "```", *failures[:60], "```", ""]
    return failed


def _probe(report: list[str], log: pathlib.Path) -> bool:
    """torch's CUDA arithmetic against lpsim's model of it, into the report; True if it broke."""
    report += ["", "## torch's CUDA arithmetic (tools/torch_cuda_arithmetic.py)", ""]
    before = log.stat().st_size
    status, _ = _run([sys.executable, "tools/torch_cuda_arithmetic.py"], log, 60)
    text = log.read_text(errors="replace")[before:]
    report += ["```", text.strip()[-4000:], "```", ""]
    return status != 0


def benchmark_commands(quick: bool) -> list[tuple[str, list[str]]]:
    """Each benchmark's name and the arguments of its GPU section (after the interpreter)."""
    size, repeat = (2**26, 10) if quick else (2**28, 30)
    return [
        (
            "quantize",
            [
                "benchmarks/bench_quantize.py",
                "--no-cpu",
                "--gpu-size",
                str(size),
                "--gpu-repeat",
                str(repeat),
            ],
        ),
        (
            "scaled",
            [
                "benchmarks/bench_scaled.py",
                "--device",
                "cuda",
                "--size",
                str(size),
                "--repeat",
                str(repeat),
            ],
        ),
        (
            "statistics",
            [
                "benchmarks/bench_statistics.py",
                "--device",
                "cuda",
                "--size",
                str(size // 4),
                "--repeat",
                str(repeat),
            ],
        ),
        (
            "training",
            [
                "benchmarks/bench_training.py",
                "--device",
                "cuda",
                "--models",
                "resnet18,vgg16",
                "--recipes",
                "fp16,block8",
                "--repeat",
                "5" if quick else "10",
            ],
        ),
        (
            "mac",
            [
                "benchmarks/bench_mac.py",
                "--device",
                "cuda",
                "--shapes",
                "2048x2048x256",
                "--budget",
                "1",
                "--only",
                "native,sequential,chunked,H100,DeepSeek",
                *(["--quick"] if quick else []),
            ],
        ),
    ]


def _benchmarks(
    report: list[str], log: pathlib.Path, deadline: float, quick: bool, chosen: list[str]
) -> bool:
    """The GPU sections of the chosen benchmarks, each within its share of the time left, into the
    report; True if one failed or ran out of time."""
    report += ["", "## Benchmarks", ""]
    budget = max(deadline - time.monotonic(), 30)
    # The benchmarks run as scripts (sys.path[0] is benchmarks/): lpsim, built in place, is found
    # through PYTHONPATH.
    bench_env = dict(os.environ)
    bench_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    benchmarks = [(name, bench) for name, bench in benchmark_commands(quick) if name in chosen]
    total = sum(SHARES[name] for name, _ in benchmarks)
    failed = False
    for name, bench in benchmarks:
        before = log.stat().st_size
        status, seconds = _run(
            [sys.executable, *bench], log, budget * SHARES[name] / total, bench_env
        )
        text = log.read_text(errors="replace")[before:]
        report += [f"### {BENCHMARK_TITLES[name]}", ""]
        report += [f"`{' '.join(bench)}`: status {status}, {seconds:.0f} s", ""]
        report += ["```", text.strip()[-6000:], "```", ""]
        failed |= status != 0
    return failed


if __name__ == "__main__":
    sys.exit(main())

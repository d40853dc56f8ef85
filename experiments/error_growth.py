"""Growth of the rounding error of y = A x with every addition rounded, under round to nearest and
stochastic rounding (Connolly, Higham and Mary, "Stochastic rounding and its probabilistic
backward error analysis", SIAM J. Sci. Comput. 2021).

A is 100 x n with entries uniform on [0, 1e-3], x has entries uniform on [0, 1]; both are rounded
(to nearest) into the working format, float16 or bfloat16, so that they are exact inputs. Each
y_i is computed by lpsim.accumulate.matvec: recursive summation over j = 1..n of the exact products
a_ij x_j, every partial sum rounded into the working format by the rule under test: nearest,
stochastic (32 random bits), and stochastic with rbits = 16, 8, 4 and 2. The backward error is

    max_i |yhat_i - y_i| / (|A| |x|)_i        (y computed in float64 from the same inputs)

for n from 10 to 10**5. Round to nearest obeys the deterministic bound (n - 1) u / (1 - (n - 1) u)
and, with all terms positive, grows like n u until the sum stagnates (the error then tends to 1);
stochastic rounding is unbiased and its error grows like sqrt(n) u with high probability. With few
random bits stochastic rounding is biased (it acts as if the sum were first truncated to rbits
bits below the last kept one), and the error grows like n times that bias once it dominates.

    python -m experiments.error_growth       # writes docs/results/error_growth.{md,png}
    python -m experiments.error_growth --out DIR    # writes DIR/error_growth.{md,png} instead

About 30 s on an idle 2-core machine (three independent (A, x) per n).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import lpsim  # noqa: E402
from experiments.runs import positive_int  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FORMATS = {  # name: (format, container, unit roundoff u = 2**-(precision))
    "float16": (lpsim.Float(5, 10), torch.float16, 2.0**-11),
    "bfloat16": (lpsim.Float(8, 7), torch.bfloat16, 2.0**-8),
}
RULES = [
    ("nearest", None),
    ("stochastic", None),
    ("stochastic", 16),
    ("stochastic", 8),
    ("stochastic", 4),
    ("stochastic", 2),
]


def label(rule: str, rbits: int | None) -> str:
    if rule == "nearest":
        return "nearest"
    return "stochastic" if rbits is None else f"stochastic, rbits={rbits}"


def backward_error(n: int, rows: int, fmt, dtype, rule: str, rbits, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    a = (torch.rand(rows, n, generator=g, dtype=torch.float64) * 1e-3).to(dtype)
    x = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    exact = a.double() @ x.double()  # |A||x| = A x: every entry is non-negative
    approx = lpsim.accumulate.matvec(a, x, acc=fmt, rounding=rule, rbits=rbits, seed=seed).double()
    return ((approx - exact).abs() / exact).max().item()


def panel_title(name: str, u: float, rows: int) -> str:
    """The title of a format's panel: its unit roundoff and the shape of A."""
    return f"{name} accumulation (u = 2^{int(math.log2(u))}), A x with A {rows} x n"


def plot(results: dict, ns: list[int], rows: int, path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2), sharey=True)
    colors = {
        "nearest": "tab:red",
        "stochastic": "tab:blue",
        "stochastic, rbits=16": "tab:cyan",
        "stochastic, rbits=8": "tab:green",
        "stochastic, rbits=4": "tab:olive",
        "stochastic, rbits=2": "tab:orange",
    }
    for ax, (name, (_, _, u)) in zip(axes, FORMATS.items()):
        # The plain stochastic curve last and widest: rbits=16 lies on top of it.
        order = [lab for lab in results[name] if lab != "stochastic"] + ["stochastic"]
        for rule_label in order:
            runs = results[name][rule_label]
            mean = [sum(r) / len(r) for r in runs]
            low = [min(r) for r in runs]
            high = [max(r) for r in runs]
            wide = rule_label == "stochastic"
            ax.plot(
                ns,
                mean,
                "o-",
                color=colors[rule_label],
                label=rule_label,
                markersize=5 if wide else 3,
                linewidth=2.5 if wide else 1.2,
            )
            ax.fill_between(ns, low, high, color=colors[rule_label], alpha=0.15)
        ax.plot(ns, [n * u for n in ns], "k--", label="n u")
        ax.plot(ns, [math.sqrt(n) * u for n in ns], "k:", label="sqrt(n) u")
        ax.axhline(math.sqrt(u), color="grey", linestyle="-.", linewidth=1, label="sqrt(u)")
        ax.axvline(1 / u, color="grey", linewidth=0.8, alpha=0.5)
        ax.text(1 / u * 1.1, 2e-4, "n = 1/u", color="grey", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1e-4, 3)
        ax.set_xlabel("n (length of each inner product)")
        ax.set_title(panel_title(name, u, rows))
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("backward error max_i |yhat - y|_i / (|A||x|)_i")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict, ns: list[int], seconds: float, args) -> str:
    lines = [
        "# Error growth of A x with every addition rounded: nearest against stochastic rounding",
        "",
        f"Written by `python -m experiments.error_growth` ({seconds:.0f} s on this machine). A is "
        f"{args.rows} x n, uniform on [0, 1e-3], x uniform on [0, 1], both stored in the working "
        "format; products exact, every partial sum rounded into the working format. Backward error "
        f"max_i |yhat - y|_i / (|A||x|)_i, mean of {args.repeats} independent (A, x) (min and max "
        "in the plot). u is the unit roundoff.",
        "",
    ]
    for name, (_, _, u) in FORMATS.items():
        labels = list(results[name])
        lines += [
            f"## {name} (u = 2^{int(math.log2(u))} = {u:.3g})",
            "",
            "| n | n u | sqrt(n) u | " + " | ".join(labels) + " |",
            "|---:|---:|---:|" + "---:|" * len(labels),
        ]
        for k, n in enumerate(ns):
            cells = [f"{sum(results[name][lab][k]) / args.repeats:.2e}" for lab in labels]
            lines.append(
                f"| {n} | {n * u:.2e} | {math.sqrt(n) * u:.2e} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    lines += ["![error growth](error_growth.png)", ""]
    return "\n".join(lines)


# The largest --max-exponent: n = 10**8 float32 elements per row already take 400 MB, and 10**9 a
# row of x alone 4 GB.
MAX_EXPONENT = 8


def half_decade(text: str) -> float:
    """argparse type: the largest n's exponent, a multiple of 1/2 from 1 to MAX_EXPONENT (n runs
    over 10, 10**1.5, 10**2, ... up to 10**this)."""
    value = float(text)
    if not (math.isfinite(value) and 1 <= value <= MAX_EXPONENT and (2 * value).is_integer()):
        raise argparse.ArgumentTypeError(
            f"must be a multiple of 0.5 from 1 to {MAX_EXPONENT}, got {text}"
        )
    return value


def lengths(max_exponent: float) -> list[int]:
    """n = 10**(1 + k/2) rounded, for k = 0, 1, ... up to 10**max_exponent."""
    return [int(round(10 ** (1 + k / 2))) for k in range(int(2 * (max_exponent - 1)) + 1)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.error_growth", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=positive_int, default=100, help="rows of A (default 100)")
    p.add_argument(
        "--max-exponent",
        type=half_decade,
        default=5.0,
        help=f"largest n is 10**this, a multiple of 0.5 from 1 to {MAX_EXPONENT} (default 5)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="independent (A, x) per n (default 3)"
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=RESULTS,
        metavar="DIR",
        help="directory for error_growth.md and error_growth.png (default: "
        "docs/results, where the committed results are regenerated; give another "
        "for trial runs)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    start = time.time()
    ns = lengths(args.max_exponent)
    results = {}
    for name, (fmt, dtype, _) in FORMATS.items():
        results[name] = {}
        for rule, rbits in RULES:
            runs = [
                [
                    backward_error(n, args.rows, fmt, dtype, rule, rbits, seed)
                    for seed in range(args.repeats)
                ]
                for n in ns
            ]
            results[name][label(rule, rbits)] = runs
            print(
                f"{name:9s} {label(rule, rbits):22s} "
                + " ".join(f"{sum(r) / len(r):.1e}" for r in runs),
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, ns, args.rows, args.out / "error_growth.png")
    report = table(results, ns, time.time() - start, args)
    (args.out / "error_growth.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()

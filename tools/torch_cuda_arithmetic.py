"""Which float32 expression each of torch's CUDA ops that the optimizers use computes: for each op,
the number of elements (of N random ones, over mixed magnitudes) on which the op's result differs
from each candidate expression. lpsim/optim_step.h's device forms are the candidates with 0.

    python3 tools/torch_cuda_arithmetic.py [N]

The candidates are evaluated on the CPU in float64 and rounded once to float32: a product of two
float32 values is exact in float64, so "fma(x, y, z)" is x * y + z rounded twice (to float64, then
float32), which differs from the single rounding on about one element in 2^29.
"""

from __future__ import annotations

import sys

import torch


def _sample(n: int, gen: torch.Generator) -> torch.Tensor:
    scale = torch.exp2(torch.randint(-20, 4, (n,), generator=gen).double())
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).float()


def _round(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _f32(x: float) -> float:
    """The Python float x rounded to float32, as ATen converts a Scalar for a float32 kernel."""
    return float(torch.tensor(x, dtype=torch.float32))


def _reciprocal(s: float) -> float:
    """1 / float(s) in float32: the factor of ATen's CUDA division by a Python float s."""
    return float(torch.tensor(1.0) / torch.tensor(_f32(s)))


def _divisions(a: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """a / s for the divisors s = (1 - 0.999^t)^0.5 of Adam's steps t = 1..50, a slice of a for
    each: one divisor cannot tell a float32 reciprocal 1/float(s) from float(1/s), 50 can."""
    pieces = torch.tensor_split(a, 50)
    got, divided, by_float_reciprocal, by_double_reciprocal = [], [], [], []
    for t, piece in enumerate(pieces, start=1):
        s = (1 - 0.999**t) ** 0.5
        got.append((piece.cuda() / s).cpu())
        P = piece.double()
        divided.append(_round(P / _f32(s)))
        by_float_reciprocal.append(_round(P * _reciprocal(s)))
        by_double_reciprocal.append(_round(P * _f32(1 / s)))
    return torch.cat(got), {
        "a / float(s)": torch.cat(divided),
        "a * (1/float(s))": torch.cat(by_float_reciprocal),
        "a * float(1/s)": torch.cat(by_double_reciprocal),
    }


def _fma(x, y, z) -> torch.Tensor:
    """fma(x, y, z) of float32 values (float64 tensors or floats), rounded to float32."""
    return _round(torch.as_tensor(x, dtype=torch.float64) * y + z).double()


def _adam_step(n: int, gen: torch.Generator) -> dict:
    """One step of torch.optim.Adam (foreach=False) on CUDA from a random state, against chains of
    forms evaluated here: lpsim/optim_step.h's device forms, and each of them swapped for its
    alternative (the CPU's addcmul, a true division by the bias correction or the reciprocal taken
    in double, the CPU's addcdiv). Step 3 of a run, whose bias corrections tell the reciprocals
    apart. The parameter, exp_avg and exp_avg_sq."""
    lr, (beta1, beta2), eps, step = 1e-2, (0.9, 0.999), 1e-8, 3
    p0, g = _sample(n, gen), _sample(n, gen)
    m0, v0 = _sample(n, gen), _sample(n, gen).square()
    P, G, M, V = (t.double() for t in (p0, g, m0, v0))
    param = torch.nn.Parameter(p0.cuda())
    param.grad = g.cuda()
    opt = torch.optim.Adam([param], lr=lr, betas=(beta1, beta2), eps=eps, foreach=False)
    opt.state[param] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": m0.cuda(),
        "exp_avg_sq": v0.cuda(),
    }
    opt.step()
    f = _f32
    m = _fma(f(1 - beta1), _round(G - M).double(), M)
    decayed = _round(V * f(beta2)).double()
    v_forms = {
        "device": _fma(f(1 - beta2), _round(G * G).double(), decayed),
        "CPU addcmul": _fma(_round(f(1 - beta2) * G).double(), G, decayed),
    }
    s = (1 - beta2**step) ** 0.5
    scalings = {
        "device": lambda r: _round(r * _reciprocal(s)),
        "true division": lambda r: _round(r / f(s)),
        "reciprocal in double": lambda r: _round(r * f(1 / s)),
    }
    neg_step = f(-(lr / (1 - beta1**step)))
    updates = {
        "device": lambda denom: _fma(neg_step, _round(m / denom).double(), P),
        "CPU addcdiv": lambda denom: _round(
            P + _round(_round(neg_step * m).double() / denom).double()
        ),
    }
    params = {}
    for v_name, v in v_forms.items():
        root = _round(torch.sqrt(v)).double()
        for scale_name, scale in scalings.items():
            denom = _round(scale(root).double() + f(eps)).double()
            for update_name, update in updates.items():
                names = [x for x in (v_name, scale_name, update_name) if x != "device"]
                params[", ".join(names) or "device forms"] = _round(update(denom))
    state = opt.state[param]
    return {
        "Adam step: exp_avg": (state["exp_avg"], {"device forms": _round(m)}),
        "Adam step: exp_avg_sq": (
            state["exp_avg_sq"],
            {name: _round(v) for name, v in v_forms.items()},
        ),
        "Adam step: param": (param.detach(), params),
    }


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 0
    n = int(argv[0]) if argv else 1 << 20
    gen = torch.Generator().manual_seed(0)
    a, b = _sample(n, gen), _sample(n, gen)
    c = _sample(n, gen).abs() + 1e-3
    alpha, s, w_small, w_large = 0.001, 0.9986995, 0.1, 0.9
    fa, fs = _f32(alpha), _f32(s)
    A, B, C = a.double(), b.double(), c.double()
    bc = _round(B * C).double()
    b_over_c = _round(B / C).double()
    ab = _round(fa * B).double()
    inv = _reciprocal(s)
    diff = _round(B - A).double()
    cases = {
        "addcmul(a, b, c, value=alpha)": (
            torch.addcmul(a.cuda(), b.cuda(), c.cuda(), value=alpha),
            {
                "fma(alpha, b*c, a)": _round(fa * bc + A),
                "fma(alpha*b, c, a)": _round(ab * C + A),
                "a + alpha*(b*c), unfused": _round(A + _round(fa * bc).double()),
                "a + (alpha*b)*c, unfused": _round(A + _round(ab * C).double()),
            },
        ),
        "addcdiv(a, b, c, value=alpha)": (
            torch.addcdiv(a.cuda(), b.cuda(), c.cuda(), value=alpha),
            {
                "fma(alpha, b/c, a)": _round(fa * b_over_c + A),
                "a + (alpha*b)/c": _round(A + _round(ab / C).double()),
                "a + alpha*(b/c), unfused": _round(A + _round(fa * b_over_c).double()),
            },
        ),
        "a / s (python float)": (
            a.cuda() / s,
            {"a / float(s)": _round(A / fs), "a * (1/float(s))": _round(A * inv)},
        ),
        "a / s, Adam's 50 bias corrections": _divisions(a),
        "add(a, b, alpha=alpha)": (
            torch.add(a.cuda(), b.cuda(), alpha=alpha),
            {
                "fma(alpha, b, a)": _round(fa * B + A),
                "a + alpha*b, unfused": _round(A + _round(fa * B).double()),
            },
        ),
        "lerp(a, b, 0.1)": (
            torch.lerp(a.cuda(), b.cuda(), w_small),
            {
                "fma(w, b - a, a)": _round(_f32(w_small) * diff + A),
                "a + w*(b - a), unfused": _round(A + _round(_f32(w_small) * diff).double()),
            },
        ),
        "lerp(a, b, 0.9)": (
            torch.lerp(a.cuda(), b.cuda(), w_large),
            {
                "fma(w - 1, b - a, b)": _round((_f32(w_large) - 1) * diff + B),
                "b - (b - a)*(1 - w), unfused": _round(
                    B - _round(diff * (1 - _f32(w_large))).double()
                ),
            },
        ),
        "sqrt(|a|)": (
            torch.sqrt(a.abs().cuda()),
            {"correctly rounded": _round(torch.sqrt(A.abs()))},
        ),
    }
    cases.update(_adam_step(n, gen))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, {n} elements")
    print(f"{'op':34} {'candidate':30} {'differ':>8}")
    for op, (got, candidates) in cases.items():
        got = got.cpu()
        for name, want in candidates.items():
            differ = int((got.view(torch.int32) != want.view(torch.int32)).sum())
            print(f"{op:34} {name:30} {differ:8}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

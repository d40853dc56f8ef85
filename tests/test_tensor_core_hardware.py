"""The tensor-core presets against the GPU's own matrix products, bit for bit: where a preset claims
a GPU's behaviour (lpsim.mac.PRESETS, docs/accumulation.md), the model's results on the CPU equal
what that GPU's cuBLAS returns in float32 (torch.mm with out_dtype=float32 for fp16 and bf16
operands, torch._scaled_mm with fast accumulation for fp8), on inner products built to expose the
model's details: exact cancellation, alignment shifts past the kept fraction bits, carries out of
the top bit, and random ones. 128 x 128 results, K from one to eight of the preset's groups
(small, so that cuBLAS need not split a sum). Skipped without a CUDA device of a generation that
has presets (V100, A100, H100, B200); fp8 only where torch._scaled_mm runs (compute capability
8.9 and up)."""

from __future__ import annotations

import pytest
import torch

import lpsim
from lpsim import Float
from lpsim.mac import PRESETS

GPU_OF_CAPABILITY = {(7, 0): "V100", (8, 0): "A100", (9, 0): "H100", (10, 0): "B200"}


def _gpu() -> str | None:
    if not torch.cuda.is_available() or not lpsim.cuda_built():
        return None
    return GPU_OF_CAPABILITY.get(torch.cuda.get_device_capability(0))


pytestmark = pytest.mark.skipif(
    _gpu() is None, reason="needs a CUDA device of a generation with tensor-core presets"
)

# The torch dtype that carries each operand format to the GPU (the preset names the format itself).
OPERAND_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
M = N = 128


def adversarial_operands(fmt: Float, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M, k) and b (k, N), float32 tensors holding values of fmt (rounded to nearest onto it);
    row r of a is of kind (r % 32) // 8, each against every column of b:

    - random values within a few binades;
    - values over a wide range of binades (alignment shifts past the kept fraction bits);
    - pairs that cancel exactly (a[2j + 1] = -a[2j]) beside small terms;
    - the largest significand of their binade (carries out of the top bit).
    """
    gen = torch.Generator().manual_seed(seed)
    top = 4 if fmt.exp <= 4 else 8  # binades kept within the format's range

    def values(shape, low, high):
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        binade = torch.randint(low, high + 1, shape, generator=gen).float()
        return sign * torch.exp2(binade) * (1 + torch.rand(shape, generator=gen))

    largest = 2.0 - 2.0**-fmt.man  # the largest significand of a binade
    a = torch.empty(M, k)
    for r0 in range(0, M, 32):
        a[r0 : r0 + 8] = values((8, k), -2, 2)
        a[r0 + 8 : r0 + 16] = values((8, k), -top, top)
        pairs = values((8, k // 2), -2, 2)
        cancelling = a[r0 + 16 : r0 + 24]
        cancelling[:, 0::2], cancelling[:, 1::2] = pairs, -pairs
        cancelling[:, k // 2 :] *= 2.0 ** -(top // 2)  # small terms beside the cancelling pairs
        a[r0 + 24 : r0 + 32] = largest * torch.exp2(
            torch.randint(-2, 3, (8, k), generator=gen).float()
        )
    b = values((k, N), -2, 2)
    b[1::2] = b[0::2]  # so that a's cancelling pairs meet equal values of b
    b[:, -8:] = largest  # columns of largest significands
    return lpsim.quantize(a, fmt, "nearest"), lpsim.quantize(b, fmt, "nearest")


def _gpu_product(a: torch.Tensor, b: torch.Tensor, operands: str) -> torch.Tensor:
    """The GPU's own a @ b in float32, from operands of the named format."""
    dtype = OPERAND_DTYPES[operands]
    ad, bd = a.to(dtype).cuda(), b.to(dtype).cuda()
    try:
        if operands in ("e4m3", "e5m2"):
            one = torch.ones((), device="cuda")
            # b column-major, as _scaled_mm takes it; fast accumulation: the tensor cores' own sums.
            return torch._scaled_mm(
                ad, bd.t().contiguous().t(), one, one, out_dtype=torch.float32, use_fast_accum=True
            )
        return torch.mm(ad, bd, out_dtype=torch.float32)
    except (TypeError, RuntimeError) as error:  # e5m2 x e5m2, or no out_dtype in this torch
        pytest.skip(f"the GPU's float32 product of {dtype} operands is not available: {error}")


class _exact_reductions:
    """cuBLAS without reduced-precision (split-K) reductions for fp16 and bf16 products."""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.saved = (
            m.allow_fp16_reduced_precision_reduction,
            m.allow_bf16_reduced_precision_reduction,
        )
        m.allow_fp16_reduced_precision_reduction = False
        m.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction) = (
            self.saved
        )


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("operands", list(OPERAND_DTYPES))
def test_preset_equals_the_gpus_own_product(operands, groups):
    gpu = _gpu()
    name = f"{gpu}/{operands}"
    if name not in PRESETS:
        pytest.skip(f"no preset {name}")
    if operands in ("e4m3", "e5m2") and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("fp8 products need compute capability 8.9")
    mac = PRESETS[name]
    fmt = mac.tensor_core.operands
    k = mac.tensor_core.group * groups
    a, b = adversarial_operands(fmt, k, seed=groups)
    with _exact_reductions():
        got = _gpu_product(a, b, operands).cpu()
    want = lpsim.mac.matmul(a, b, mac)
    assert want.dtype == torch.float32
    differ = got.view(torch.int32) != want.view(torch.int32)
    rows = differ.any(dim=1).nonzero().flatten().tolist()
    assert not differ.any(), (
        f"{name}, K={k}: {int(differ.sum())} of {differ.numel()} results differ, in rows {rows} "
        f"(kind (row % 32) // 8: random, wide, cancelling, carries); first: "
        f"got {got[differ][:4].tolist()} want {want[differ][:4].tolist()}"
    )

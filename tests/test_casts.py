"""`nearest` with the matching preset reproduces torch's and ml_dtypes' casts bit for bit, over
every code of the target format and the neighbourhood of every rounding decision."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from support import assert_same_bits, neighbourhood

import lpsim
from lpsim.formats import preset

TORCH_CASTS = [
    ("bfloat16", torch.bfloat16),
    ("float16", torch.float16),
    ("e4m3fn_saturating", torch.float8_e4m3fn),  # torch saturates float8_e4m3fn, Inf included
    ("e5m2", torch.float8_e5m2),
    ("e4m3fnuz", torch.float8_e4m3fnuz),
    ("e5m2fnuz", torch.float8_e5m2fnuz),
]

ML_DTYPES_CASTS = [
    ("e3m4", ml_dtypes.float8_e3m4),
    ("e4m3", ml_dtypes.float8_e4m3),
    ("e4m3fn", ml_dtypes.float8_e4m3fn),  # ml_dtypes does not saturate: overflow is NaN
    ("e5m2", ml_dtypes.float8_e5m2),
    ("e4m3fnuz", ml_dtypes.float8_e4m3fnuz),
    ("e5m2fnuz", ml_dtypes.float8_e5m2fnuz),
    ("e4m3b11fnuz", ml_dtypes.float8_e4m3b11fnuz),
    ("e2m3fn", ml_dtypes.float6_e2m3fn),
    ("e3m2fn", ml_dtypes.float6_e3m2fn),
    ("e2m1fn", ml_dtypes.float4_e2m1fn),
]


def _inputs(fmt) -> torch.Tensor:
    # Well past the largest value, so that saturation and overflow to Inf/NaN are both seen.
    return neighbourhood(fmt.values(), torch.float32, beyond=4 * fmt.max)


@pytest.mark.parametrize("name,dtype", TORCH_CASTS, ids=[n for n, _ in TORCH_CASTS])
def test_nearest_matches_torch_cast(name, dtype):
    fmt = preset(name)
    x = _inputs(fmt)
    want = x.to(dtype).float()
    assert_same_bits(lpsim.quantize(x, fmt, "nearest"), want, name)


@pytest.mark.parametrize("name,dtype", TORCH_CASTS[:2], ids=[n for n, _ in TORCH_CASTS[:2]])
@pytest.mark.parametrize("container", [torch.float64], ids=["float64"])
def test_nearest_matches_torch_cast_from_wider_container(name, dtype, container):
    fmt = preset(name)
    x = _inputs(fmt).to(container)
    assert_same_bits(lpsim.quantize(x, fmt, "nearest"), x.to(dtype).to(container), name)


@pytest.mark.parametrize("name,dtype", ML_DTYPES_CASTS, ids=[n for n, _ in ML_DTYPES_CASTS])
def test_nearest_matches_ml_dtypes_cast(name, dtype):
    fmt = preset(name)
    x = _inputs(fmt)
    if not fmt.has_nan:
        # ml_dtypes turns NaN into -0.0 in formats that have no NaN; lpsim keeps NaN (the
        # container holds it), a documented difference checked below.
        x = x[~torch.isnan(x)]
    want = torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))
    assert_same_bits(lpsim.quantize(x, fmt, "nearest"), want, name)


@pytest.mark.parametrize("name", ["e2m3fn", "e3m2fn", "e2m1fn"])
def test_nan_stays_nan_in_formats_without_nan(name):
    y = lpsim.quantize(torch.tensor([math.nan, -math.nan]), preset(name), "nearest")
    assert torch.isnan(y).all()


def test_bfloat16_container_matches_torch_float8_cast():
    # Rounding a bfloat16 tensor into e5m2 equals torch's bfloat16 -> float8_e5m2 cast.
    fmt = preset("e5m2")
    x = torch.cat([_inputs(fmt).to(torch.bfloat16), torch.randn(4096).to(torch.bfloat16)])
    want = x.to(torch.float8_e5m2).to(torch.bfloat16)
    assert_same_bits(lpsim.quantize(x, fmt, "nearest"), want, "bfloat16 container")

"""Loading of the compiled kernels and their registration with torch: fake (meta) kernels, so that
torch.compile can trace the ops, and the straight-through gradient of the functional ops."""

from __future__ import annotations

import torch

try:
    from lpsim import _C  # noqa: F401  (loading it registers the torch.ops.lpsim ops)
except ImportError as error:  # pragma: no cover - exercised by hand on an unbuilt checkout
    raise ImportError(
        "lpsim's compiled kernels (lpsim._C) are not built. Build them from the repository root "
        "with:  pip install --no-build-isolation -e .   (`make test` also creates .venv and "
        f"builds). Original error: {error}"
    ) from error

ops = torch.ops.lpsim


def cuda_built() -> bool:
    """Whether the CUDA kernels were compiled into this build."""
    return bool(_C.cuda_built())


def cpu_generator() -> str:
    """Which implementation of the random-word generator the CPU kernels use: "avx2" or "scalar"
    (both give the same words)."""
    return str(_C.cpu_generator())


# Fake kernels: shapes and dtypes only. The compiled kernels return contiguous tensors.


@torch.library.register_fake("lpsim::quantize_grid")
def _quantize_grid_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("lpsim::quantize_block")
def _quantize_block_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("lpsim::quantize_grid_")
def _quantize_grid_inplace_fake(x, *args):
    return None


@torch.library.register_fake("lpsim::quantize_block_")
def _quantize_block_inplace_fake(x, *args):
    return None


@torch.library.register_fake("lpsim::quantize_grid_out")
def _quantize_grid_out_fake(x, *args, out):
    return None


@torch.library.register_fake("lpsim::quantize_block_out")
def _quantize_block_out_fake(x, *args, out):
    return None


# Straight-through estimator: quantisation passes the gradient unchanged.

_GRID_ARGS = 13  # arguments after x in quantize_grid's schema
_BLOCK_ARGS = 7  # arguments after x in quantize_block's schema


def _straight_through(count: int):
    def backward(ctx, grad):
        return (grad,) + (None,) * count

    return backward


torch.library.register_autograd("lpsim::quantize_grid", _straight_through(_GRID_ARGS))
torch.library.register_autograd("lpsim::quantize_block", _straight_through(_BLOCK_ARGS))

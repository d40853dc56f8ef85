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


def arguments_after(op: str, first: int) -> int:
    """How many arguments follow the first ``first`` ones in the registered schema of
    ``torch.ops.lpsim.<op>``: what a backward returns None for. Read from the schema, so that a
    field added to the grid (csrc/include/lpsim/grid_spec.h, lpsim/formats.py's GridSpec) needs no
    count changed here."""
    return len(getattr(ops, op).default._schema.arguments) - first


# Straight-through estimator: quantisation passes the gradient unchanged.


def _straight_through(count: int):
    def backward(ctx, grad):
        return (grad,) + (None,) * count

    return backward


for _name in ("quantize_grid", "quantize_block"):
    torch.library.register_autograd(f"lpsim::{_name}", _straight_through(arguments_after(_name, 1)))

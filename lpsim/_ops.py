"""Loading of the compiled kernels, their fake (meta) kernels, so that torch.compile can trace the
ops, and ``call``, the one way lpsim's Python layer runs an op. The ops' autograd kernels are C++
(csrc/autograd.cpp)."""

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


class _Op:
    """What call() needs of one op: its handle in lpsim._C, and from its schema the positions of
    its tensor arguments and the names of its keyword-only ones."""

    __slots__ = ("handle", "overload", "tensors", "keywords")

    def __init__(self, name: str):
        self.handle = _C.op_handle(name)
        self.overload = getattr(ops, name).default
        arguments = self.overload._schema.arguments
        self.tensors = [
            i for i, a in enumerate(arguments) if str(a.type) in ("Tensor", "Optional[Tensor]")
        ]
        self.keywords = [a.name for a in arguments if a.kwarg_only]


# Every lpsim op, from the schemas the library registered (~16 ms at import). Built here, not on
# first use: dynamo cannot trace _C.op_handle.
_OPS: dict[str, _Op] = {
    schema.name.removeprefix("lpsim::"): _Op(schema.name.removeprefix("lpsim::"))
    for schema in torch._C._jit_get_all_schemas()
    if schema.name.startswith("lpsim::") and not schema.overload_name
}


def call(name: str, *args):
    """torch.ops.lpsim.<name>(*args), with every argument given positionally in schema order
    (keyword-only ones last), and a Python int allowed for a seed (any Tensor argument): it stands
    for a 0-d int64 CPU tensor holding it.

    In eager mode the call goes through lpsim._C.call, which reaches the same dispatcher entry
    without torch.ops' Python and argument parsing (about 10 us a call; csrc/module.cpp). While
    torch.compile traces, for tensor subclasses and under a TorchFunctionMode it goes through
    torch.ops, so that dynamo and __torch_function__ see the op.
    """
    op = _OPS[name]
    if not torch.compiler.is_compiling():
        result = _C.call(op.handle, args)
        if result is not NotImplemented:
            return result
    return _through_torch_ops(op, args)


def call_in_place(name: str, *args, written: int = 0) -> None:
    """call(name, *args) for an op that writes into the tensor args[written]: x of the in-place
    ops (quantize_grid_, sr_add_, ...), out of the out= ops (written=-1).

    A written tensor with torch's negative bit (torch._neg_view, z.conj().imag) is rounded
    through a copy of its values without the bit, which is then copied into it: torch's fallback
    for such views expects an op that writes into a tensor to return it, and with lpsim's ops,
    which return nothing, it corrupted the heap. The copy keeps every rule of the op on the
    tensor: its values and random draws, its version counter, the refusal of a leaf that
    requires grad and, through a non-leaf, its gradient. Not while torch.compile traces, which
    cannot branch on the bit: there the traced op fails on such a view with an error (no
    corruption)."""
    target = args[written]
    if not torch.compiler.is_compiling() and target.is_neg():
        plain = target.resolve_neg()
        args = list(args)
        args[written] = plain
        call(name, *args)
        target.copy_(plain)
        return
    call(name, *args)


def call_directly(name: str, *args):
    """call()'s eager way only: lpsim._C.call's result, or NotImplemented for arguments it does not
    take (see csrc/module.cpp)."""
    return _C.call(_OPS[name].handle, args)


def _through_torch_ops(op: _Op, args: tuple):
    """The op through torch.ops, seeds given as ints made tensors, keyword-only arguments named."""
    args = list(args)
    for i in op.tensors:
        if isinstance(args[i], int):
            args[i] = torch.tensor(args[i], dtype=torch.int64)
    keywords = {}
    for keyword in reversed(op.keywords):
        keywords[keyword] = args.pop()
    return op.overload(*args, **keywords)


def cuda_built() -> bool:
    """Whether the CUDA kernels were compiled into this build."""
    return bool(_C.cuda_built())


def cpu_generator() -> str:
    """Which implementation of the random-word generator the CPU kernels use: "avx512vl",
    "avx2" or "scalar" (all give the same words)."""
    return str(_C.cpu_generator())


# Fake kernels: shapes and dtypes only. The compiled kernels return contiguous tensors.


def _new_tensor_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _in_place_fake(x, *args):
    return None


def _out_fake(x, *args, out):
    return None


for _name in ("quantize_grid", "quantize_block"):
    torch.library.register_fake(f"lpsim::{_name}")(_new_tensor_fake)
    torch.library.register_fake(f"lpsim::{_name}_")(_in_place_fake)
    torch.library.register_fake(f"lpsim::{_name}_out")(_out_fake)


# quantize_scaled, quantize_scaled_ and quantize_scaled_out have C++ Meta kernels instead
# (csrc/scaled_ops.cpp), which make the compiled kernels' checks of (block, axis).


@torch.library.register_fake("lpsim::to_container")
def _to_container_fake(x, dtype):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


# The sums and products of lpsim.accumulate and lpsim.mac: float64 results
# (csrc/accumulate_ops.cpp), so that torch.compile and torch.export trace them as ops of a graph.


@torch.library.register_fake("lpsim::sum_rounded")
def _sum_rounded_fake(x, outer, n, inner, cumulative, *args):
    return x.new_empty((outer * n * inner if cumulative else outer * inner,), dtype=torch.float64)


def _product_results_fake(a, b, *args):
    """The (m, p) float64 results of a (m, n) times the rows of b (p, n)."""
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float64)


torch.library.register_fake("lpsim::dot_rounded")(_product_results_fake)
torch.library.register_fake("lpsim::mac_matmul")(_product_results_fake)


@torch.library.register_fake("lpsim::rounding_statistics")
def _rounding_statistics_fake(x, rounded, low, high, smallest_normal):
    # The statistics ops count values into CPU tensors, whatever x's device. A meta x (the fake
    # kernels serve the meta device too) holds none to count: returning the uninitialised
    # tensors below would read as counts.
    if x.device.type == "meta":
        raise ValueError(
            "x is a meta tensor, which holds no values: rounding statistics count the values of a "
            "tensor on a CPU or CUDA device"
        )
    return torch.empty(6, dtype=torch.int64), torch.empty(2, dtype=torch.float64)


@torch.library.register_fake("lpsim::scaled_rounding_statistics")
def _scaled_rounding_statistics_fake(x, rounded, *args):
    return _rounding_statistics_fake(x, rounded, 0.0, 0.0, 0.0)


@torch.library.register_fake("lpsim::block_rounding_statistics")
def _block_rounding_statistics_fake(x, rounded, *args):
    return _rounding_statistics_fake(x, rounded, 0.0, 0.0, 0.0)


@torch.library.register_fake("lpsim::quantize_grid_statistics")
def _quantize_grid_statistics_fake(x, *args):
    return _new_tensor_fake(x), *_rounding_statistics_fake(x, x, 0.0, 0.0, 0.0)

"""Orthogonal transforms applied before quantisation: the random Hadamard transform.

A block format (BlockFloat, MX, NVFP4) gives a block of consecutive elements one shared scale, set
by the block's largest magnitude; one outlier then coarsens the spacing of every other element of
its block, and the small ones round to zero. Multiplying each block by an orthogonal matrix whose
entries all have the same magnitude spreads an outlier evenly over the block before it is
quantised, and the transposed matrix undoes it afterwards. NVIDIA's NVFP4 training recipe and
Tseng et al., "Training LLMs with MXFP4" (2025), use the random Hadamard transform of 16 elements
on both operands of the weight-gradient product, along its reduction dimension.

``RandomHadamard(size, axis, seed)`` describes the transform: the ``size`` x ``size`` matrix
``H @ diag(s) / sqrt(size)``, H the Sylvester Hadamard matrix and s a vector of random signs drawn
from ``seed``. ``apply`` multiplies each group of ``size`` consecutive elements along ``axis`` by
it, ``inverse`` by its transpose.

    >>> import torch, lpsim
    >>> t = lpsim.RandomHadamard(4, seed=None)         # no random signs: the plain H / 2
    >>> t.matrix()
    tensor([[ 0.5000,  0.5000,  0.5000,  0.5000],
            [ 0.5000, -0.5000,  0.5000, -0.5000],
            [ 0.5000,  0.5000, -0.5000, -0.5000],
            [ 0.5000, -0.5000, -0.5000,  0.5000]])
    >>> t.apply(torch.tensor([8.0, 0.0, 0.0, 0.0]))     # an outlier spread over its group
    tensor([4., 4., 4., 4.])
    >>> t.inverse(t.apply(torch.tensor([8.0, 0.0, 0.0, 0.0])))
    tensor([8., 0., 0., 0.])

See docs/transforms.md for its use on the two operands of a matrix product.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import torch

from lpsim._checks import (
    CONTAINER_DTYPES,
    MAX_SEED,
    check_container,
    check_strided,
    signature_kept,
)

__all__ = ["RandomHadamard", "MAX_SIZE", "MATMUL_MAX_SIZE"]

MAX_SIZE = 2**15  # the largest RandomHadamard.size
MATMUL_MAX_SIZE = 256  # apply/inverse multiply by the matrix up to this size, else a butterfly


@dataclass(frozen=True)
class RandomHadamard:
    """The random Hadamard transform of groups of ``size`` consecutive elements along ``axis``.

    Its matrix is ``R = H @ diag(s) / sqrt(size)``: H the Sylvester Hadamard matrix of order
    ``size`` (H[i, j] = (-1)**popcount(i & j), the Kronecker power of [[1, 1], [1, -1]]) and s the
    vector of ``size`` random signs that ``signs()`` returns. R is orthogonal (R @ R.T = I), and so
    is the whole transform: ``inverse(apply(x)) == x`` up to rounding. ``apply`` maps each group g
    (a vector of ``size`` consecutive elements along ``axis``) to ``R @ g``: g's signs are flipped
    by s, then the Walsh-Hadamard transform mixes the group, each output being a signed sum of all
    inputs divided by sqrt(size). ``inverse`` maps a group to ``R.T @ g``.

    Use in a matrix product. For ``a @ b`` with reduction dimension k (a's last axis, b's first),
    transform both operands along k with the same size and seed:
    ``RandomHadamard(16, axis=-1, seed=s).apply(a) @ RandomHadamard(16, axis=0, seed=s).apply(b)``
    equals ``a @ b`` up to rounding, since it is a R' R'.T b with R' = blockdiag(R.T, ..., R.T)
    orthogonal. Quantising the transformed operands instead of a and b is the NVFP4 recipe's use.

    Args:
        size: elements per group, a power of two from 2 to 2**15 (MAX_SIZE). 16 is the NVFP4
            recipe's.
        axis: the dimension split into groups, an int; negative values count from the end, as in
            torch. Its length in x must be a multiple of ``size`` (checked by apply/inverse).
        seed: the random signs' seed, 0 <= seed < 2**64; None: no random signs (s = 1, R is the
            normalised Hadamard matrix H / sqrt(size)).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: size is not a power of two in [2, 2**15], or seed is out of range.
    """

    size: int = 16
    axis: int = -1
    seed: int | None = 0
    # Float64 CPU tensors shared through caches by every transform of the same size and seed, and
    # never written: the signs, and the matrix where apply multiplies by it (else None). Held here,
    # torch.compile reads them as constants instead of tracing their construction.
    _signs: torch.Tensor = field(init=False, repr=False, compare=False)
    _matrix: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool):
            raise TypeError(f"RandomHadamard.size must be an int, got {type(self.size).__name__}")
        if not 2 <= self.size <= MAX_SIZE or self.size & (self.size - 1):
            raise ValueError(
                f"RandomHadamard.size must be a power of two from 2 to 2**15 = {MAX_SIZE}, "
                f"got {self.size}"
            )
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(f"RandomHadamard.axis must be an int, got {type(self.axis).__name__}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise TypeError(
                    f"RandomHadamard.seed must be an int or None, got {type(self.seed).__name__}"
                )
            if not 0 <= self.seed < MAX_SEED:
                raise ValueError(f"RandomHadamard.seed must be in [0, 2**64), got {self.seed}")
        small = self.size <= MATMUL_MAX_SIZE
        object.__setattr__(self, "_signs", _cached_signs(self.size, self.seed))
        object.__setattr__(self, "_matrix", _cached_matrix(self.size, self.seed) if small else None)

    def signs(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The random signs s, a tensor of ``size`` values +1 or -1 of ``dtype`` on ``device``.

        They are drawn on the CPU, whatever ``device`` (and torch's default device), so a seed
        gives the same signs on every device; with torch's generator they are exactly

            generator = torch.Generator().manual_seed(seed)
            s = 1 - 2 * torch.randint(2, (size,), generator=generator)

        (a drawn 1 is the sign -1). With seed None every sign is +1.

        Raises:
            TypeError: dtype is not float32, float64, bfloat16 or float16.
        """
        _check_dtype(dtype)
        return self._signs.to(dtype=dtype, device=device, copy=True)

    def matrix(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """R = H @ diag(s) / sqrt(size), a new ``size`` x ``size`` tensor of ``dtype`` on
        ``device``.

        Its entries are +/-1/sqrt(size) correctly rounded to float64 (exact when size is a power
        of 4, since 1/sqrt(size) is then a power of two), then rounded to ``dtype``. The matrix
        has size**2 elements: 2**30 for the largest size, 8 GiB in float64; apply and inverse do
        not form it above MATMUL_MAX_SIZE.

        Raises:
            TypeError: dtype is not float32, float64, bfloat16 or float16.
        """
        _check_dtype(dtype)
        r = self._matrix if self._matrix is not None else _build_matrix(self._signs)
        return r.to(dtype=dtype, device=device, copy=True)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x with each group g of ``size`` consecutive elements along ``axis`` replaced by R @ g.

        Args:
            x: a float32, float64, bfloat16 or float16 tensor of at least one dimension, on any
                device, any strides; the length of ``axis`` must be a multiple of ``size``.

        Returns:
            A new tensor of x's shape, dtype and device. It is computed in float64 for a float64 x
            and in float32 otherwise (inside torch.autocast too, which does not lower it), and
            rounded once to x's dtype. Up to size MATMUL_MAX_SIZE
            each group is multiplied by the matrix (a float32 product on CUDA follows torch's
            matmul precision setting, TF32 if allowed), whose rounding may depend on the number of
            groups in x (the library picks its kernel by shape); above it, a Walsh-Hadamard
            butterfly (size * log2(size) additions per group) does the same. The product is the
            transform's own: no TorchFunctionMode sees it, so the result is the same inside an
            lpsim.nn.quantize_functions context, whose "matmul" entries would round its
            operands. The transform is linear and differentiable: the gradient with respect to x
            is ``inverse`` of the output's, bit for bit (and the gradient of ``inverse`` is
            ``apply`` of it), computed by a custom autograd function, which supports no
            forward-mode AD. Under
            torch.compile(fullgraph=True) the signs and the matrix are constants of the graph.
            An output can reach sqrt(size) times its group's largest magnitude, and one beyond
            x's dtype's range (float16's 65504, say) rounds to infinity.

        Raises:
            TypeError: x is not a strided (dense) tensor of a supported dtype.
            IndexError: ``axis`` is not a dimension of x (or x is 0-dimensional).
            ValueError: the length of ``axis`` is not a multiple of ``size``.
        """
        return self._transform(x, inverse=False)

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        """x with each group g of ``size`` consecutive elements along ``axis`` replaced by
        R.T @ g: the inverse of ``apply``, exact up to rounding. Arguments, result and errors as
        for apply()."""
        return self._transform(x, inverse=True)

    def _transform(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        self._check(x)
        return _Rotation.apply(x, self, inverse)

    def _check(self, x: torch.Tensor) -> None:
        check_container(x)
        check_strided(x, "x", "RandomHadamard")
        if x.dim() == 0:
            raise IndexError("RandomHadamard transforms tensors of at least one dimension, x has 0")
        if not -x.dim() <= self.axis < x.dim():
            raise IndexError(
                f"RandomHadamard.axis must be in [{-x.dim()}, {x.dim() - 1}] for a tensor of "
                f"{x.dim()} dimensions, got {self.axis}"
            )
        length = x.shape[self.axis]
        if length % self.size:
            raise ValueError(
                f"the length of axis {self.axis} of x, {length}, must be a multiple of "
                f"RandomHadamard.size, {self.size}"
            )

    def _compute(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        """apply (inverse: inverse) of a checked x."""
        length = x.shape[self.axis]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        moved = x.movedim(self.axis, -1)
        groups = moved.to(work).reshape(*moved.shape[:-1], length // self.size, self.size)
        groups = groups.contiguous()  # one layout for every x's strides: the same bits
        if self.size <= MATMUL_MAX_SIZE:
            r = self._matrix.to(dtype=work, device=x.device)
            # A group is a row here: R @ g is g @ R.T, and R.T @ g is g @ R. The product is the
            # transform's own arithmetic, not a model's: no TorchFunctionMode sees it (a
            # lpsim.nn.quantize_functions context would round its operands as a model's matmul),
            # and torch.autocast does not cast its operands to a lower precision.
            with torch._C.DisableTorchFunction(), _without_autocast(x.device):
                result = torch.matmul(groups, r if inverse else r.T)
        else:
            s = self._signs.to(dtype=work, device=x.device)
            scale = _scale(self.size)
            if inverse:  # R.T @ g = diag(s) @ H @ g / sqrt(size)
                result = _walsh_hadamard(groups) * scale * s
            else:  # R @ g = H @ (s * g) / sqrt(size)
                result = _walsh_hadamard(groups * s) * scale
        return result.reshape(moved.shape).movedim(-1, self.axis).to(x.dtype)


@signature_kept
class _Rotation(torch.autograd.Function):
    """A transform's apply or inverse, whose gradient is, bit for bit, the other one of the
    incoming gradient (torch's gradient of the product by the matrix, or of the butterfly, rounds
    otherwise, and depends on the layout the gradient arrives in). torch.compile does not trace a
    custom jvp, so it has none: forward-mode AD (torch.func.jvp) raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, transform: RandomHadamard, inverse: bool) -> torch.Tensor:
        return transform._compute(x, inverse)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.transform, ctx.inverse = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Rotation.apply(grad, ctx.transform, not ctx.inverse), None, None


def _without_autocast(device: torch.device):
    """A context in which torch.autocast, if enabled for ``device``, casts nothing."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _check_dtype(dtype) -> None:
    if dtype not in CONTAINER_DTYPES:
        raise TypeError(f"dtype must be float32, float64, bfloat16 or float16, got {dtype}")


@functools.lru_cache(maxsize=64)
def _cached_signs(size: int, seed: int | None) -> torch.Tensor:
    """The signs s (see RandomHadamard.signs) as a float64 CPU tensor.

    Built outside inference mode whatever the caller's mode: a cached inference tensor could not
    be saved for backward by a later differentiable call. On the CPU whatever torch's default
    device (torch.device("meta") as a context, torch.set_default_device): a model built there
    would otherwise cache meta tensors, or draw on another device, for every later transform."""
    with torch.inference_mode(False):
        if seed is None:
            return torch.ones(size, dtype=torch.float64, device="cpu")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        drawn = torch.randint(2, (size,), generator=generator, device="cpu")
        return (1 - 2 * drawn).to(torch.float64)


@functools.lru_cache(maxsize=64)
def _cached_matrix(size: int, seed: int | None) -> torch.Tensor:
    """R as a float64 CPU tensor (built outside inference mode, as the signs)."""
    with torch.inference_mode(False):
        return _build_matrix(_cached_signs(size, seed))


def _build_matrix(signs: torch.Tensor) -> torch.Tensor:
    """H @ diag(signs) / sqrt(size) in float64, size the length of signs."""
    size = signs.numel()
    h = torch.ones(1, 1, dtype=torch.float64, device=signs.device)
    while h.shape[0] < size:  # Sylvester: H_2n = [[H_n, H_n], [H_n, -H_n]]
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h * (signs * _scale(size))  # H @ diag(s): column j times s[j]


def _scale(size: int) -> float:
    """1/sqrt(size) correctly rounded to float64: 2**-k for size 4**k, and for size 2 * 4**k
    sqrt(0.5) * 2**-k (math.sqrt rounds correctly, and sqrt(0.5) = 1/sqrt(2))."""
    k, odd = divmod(size.bit_length() - 1, 2)
    return math.ldexp(math.sqrt(0.5) if odd else 1.0, -k)


def _walsh_hadamard(groups: torch.Tensor) -> torch.Tensor:
    """H @ g for every group g along the last dimension (unnormalised), in log2(size) passes of
    additions and subtractions.

    The last dimension is split into log2(size) dimensions of 2, one per bit of the index, and H,
    the Kronecker power of [[1, 1], [1, -1]], applies that 2 x 2 matrix along each of them. (The
    leading dimensions are never flattened: shapes computed by division would make torch.compile's
    tracing with dynamic shapes take minutes.)"""
    lead, size = groups.shape[:-1], groups.shape[-1]
    bits = size.bit_length() - 1
    y = groups.reshape(*lead, *([2] * bits))
    for dim in range(len(lead), len(lead) + bits):
        first, second = y.select(dim, 0), y.select(dim, 1)
        y = torch.stack((first + second, first - second), dim=dim)
    return y.reshape(groups.shape)

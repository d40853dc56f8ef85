"""MAC: the arithmetic of a simulated matrix product, described in full.

A matrix product c = a @ b adds, for each result c[i, j], the K products a[i, k] b[k, j]. Real
hardware does not add them exactly: the products may be rounded, every partial sum is rounded into
an accumulator of limited precision, and the order of the additions (one after another, in chunks,
as a tree) decides which roundings happen. A ``MAC`` (multiply-accumulate) states each of these
choices, so that a simulated product is reproducible from its description alone:

    >>> import lpsim
    >>> mac = lpsim.MAC(accumulator=lpsim.Float(5, 10))                     # float16 accumulator
    >>> mac.fused, mac.order
    (True, 'sequential')
    >>> lpsim.MAC(accumulator=lpsim.Float(8, 7), order="chunked", chunk=32,
    ...           chunk_accumulator=lpsim.Float(5, 10)).chunk
    32

What each field means (terms t_k are the products in increasing k; ``round`` rounds an exact value
once, by ``rounding``, onto the named format's grid):

- ``product``: None for exact products, each added by a fused multiply-add (the sum
  s + a[i, k] b[k, j] is rounded once); a format for a separate multiplier, whose products
  t_k = round_product(a[i, k] b[k, j]) are rounded before they are added. The separate
  multiply-and-add of an IEEE unit of the accumulator's own format is ``product=accumulator``.
- ``accumulator``: the format every partial sum is rounded into. None is torch's own float32
  product (torch.matmul), whose order of additions is the library's and unspecified: the fast
  path, and the default.
- ``order``:
  - ``"sequential"``: s = round(t_0), then s = round(s + t_k) for k = 1, ..., K - 1;
  - ``"chunked"``: the terms in consecutive chunks of ``chunk``, each chunk summed sequentially
    in ``chunk_accumulator`` (default: the accumulator), and each chunk's sum u added into the
    accumulator: s = round(u_0), then s = round(s + u_c);
  - ``"pairwise"``: a binary tree: the sum of terms [lo, hi) with n = hi - lo >= 2 terms is
    round(left + right), with the left part the first 2^m terms, 2^m the largest power of two
    below n; a single term is itself (rounded when it is the whole sum).
- ``compensated``: Kahan's compensated summation in the accumulator (sequential order only): a
  running compensation c carries the low part each addition lost, every operation rounded into the
  accumulator: y = round(t_k - c), u = round(s + y), c = round(round(u - s) - y), s = u.
- ``rounding``, ``rbits``: the rule of every rounding, and the random bits of a stochastic rule.

``matmul(a, b, mac)`` computes a product under a MAC (CPU; exact products need float32, bfloat16
or float16 operands):

    >>> import torch
    >>> ones = torch.ones(1, 4096)
    >>> lpsim.mac.matmul(ones, ones.t(), lpsim.MAC(accumulator=lpsim.Float(5, 10))).item()
    2048.0
    >>> lpsim.mac.matmul(ones, ones.t(), lpsim.MAC(accumulator=lpsim.Float(5, 10),
    ...                                            order="pairwise")).item()
    4096.0

Random words: with a stochastic rule, rounding j of term k of result r (results numbered in
row-major order over the result's M x N entries) draws word ``8 (r K + k) + j`` of the
position-keyed stream of (seed, offset), with j = 0 for the product's rounding; 1 for the
addition that brings term k in (sequential: into s; chunked: into its chunk's sum; pairwise: the
tree node whose right part starts at k, or term 0 when K = 1); 2 for the addition of the chunk
that ends at term k into the accumulator; and, in Kahan's summation, 3 for y, 4 for u - s and 5 for
c (1 is u).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lpsim._checks import check_choice, check_element_format, check_int
from lpsim._checks import random_args as _random_args
from lpsim._ops import call
from lpsim.accumulate import check_product_operands
from lpsim.formats import Fixed, Float, check_fits, fitting_container
from lpsim.rounding import Rounding, check_rbits
from lpsim.update import sum_grid

__all__ = ["MAC", "ORDERS", "WORDS_PER_TERM", "matmul"]

ORDERS = ("sequential", "chunked", "pairwise")
WORDS_PER_TERM = 8  # random words reserved per term and result (see the module docstring)
MAX_CHUNK = 2**31 - 1

Order = Literal["sequential", "chunked", "pairwise"]


@dataclass(frozen=True)
class MAC:
    """How a matrix product multiplies and adds (the module docstring defines every field).

    Args:
        accumulator: the format of the partial sums (a Float, Fixed or P3109); None: torch's own
            float32 product, in an unspecified order.
        product: the format each product is rounded into before it is added; None: exact products
            (fused multiply-add).
        rounding: the rule of every rounding ("nearest" by default).
        rbits: random bits of a stochastic rule, in [1, 32]; None: 32.
        order: "sequential", "chunked" or "pairwise".
        chunk: the terms per chunk, in [1, 2^31 - 1]; required by, and only for, "chunked".
        chunk_accumulator: the format of a chunk's sum ("chunked" only); None: the accumulator.
        compensated: Kahan's compensated summation ("sequential" only).

    Raises:
        TypeError: a format is not a Float, Fixed or P3109; chunk or rbits is not an int; rounding
            is not a rule.
        ValueError: a value is out of range, or a field is given that the order (or the native
            accumulator) does not use.
    """

    accumulator: Float | Fixed | None = None
    product: Float | Fixed | None = None
    rounding: Rounding | str = "nearest"
    rbits: int | None = None
    order: Order = "sequential"
    chunk: int | None = None
    chunk_accumulator: Float | Fixed | None = None
    compensated: bool = False

    def __post_init__(self) -> None:
        check_element_format("accumulator", self.accumulator)
        check_element_format("product", self.product)
        check_element_format("chunk_accumulator", self.chunk_accumulator)
        rule = Rounding.parse(self.rounding)
        object.__setattr__(self, "rounding", rule)
        check_rbits(self.rbits, rule)
        check_choice("order", self.order, ORDERS)
        if not isinstance(self.compensated, bool):
            raise TypeError(f"compensated must be a bool, got {type(self.compensated).__name__}")
        if self.order == "chunked":
            if self.chunk is None:
                raise ValueError('order="chunked" needs chunk, the number of terms per chunk')
            check_int("chunk", self.chunk, 1, MAX_CHUNK)
        elif self.chunk is not None or self.chunk_accumulator is not None:
            raise ValueError(
                f'chunk and chunk_accumulator apply to order="chunked" only, not {self.order!r}'
            )
        if self.compensated and self.order != "sequential":
            raise ValueError(
                f'compensated (Kahan) summation applies to order="sequential" only, not '
                f"{self.order!r}"
            )
        customised = (
            self.product is not None
            or self.order != "sequential"
            or self.compensated
            or rule is not Rounding.nearest
        )
        if self.accumulator is None and customised:
            raise ValueError(
                "accumulator=None is torch's own float32 product, which takes no other field: "
                "give the accumulator format to set product, order, compensated or rounding"
            )

    @property
    def fused(self) -> bool:
        """Whether each product is added by a fused multiply-add (exact products)."""
        return self.product is None

    @property
    def native(self) -> bool:
        """Whether this is torch's own float32 product (accumulator None)."""
        return self.accumulator is None

    def __str__(self) -> str:
        """A one-line summary: the accumulator, the rule, then what differs from a fused
        sequential sum ("Float(exp=8, man=7) nearest, chunk 32 in Float(exp=5, man=10)")."""
        if self.native:
            return "torch float32"
        words = [f"{self.accumulator!r} {self.rounding.name}"]
        if self.rbits is not None:
            words[0] += f" rbits={self.rbits}"
        if self.product is not None:
            words.append(f"products {self.product!r}")
        if self.order == "chunked":
            inner = f" in {self.chunk_accumulator!r}" if self.chunk_accumulator is not None else ""
            words.append(f"chunk {self.chunk}{inner}")
        elif self.order == "pairwise":
            words.append("pairwise")
        if self.compensated:
            words.append("Kahan")
        return ", ".join(words)


ORDER_CODES = {order: code for code, order in enumerate(ORDERS)}  # the op's MacOrder values


def matmul(
    a: torch.Tensor, b: torch.Tensor, mac: MAC, *, seed: int | None = None, offset: int = 0
) -> torch.Tensor:
    """c = a @ b with every result summed as ``mac`` prescribes (the module docstring defines the
    variants and the random words).

    Args:
        a: an (M, K) float32, bfloat16 or float16 CPU tensor.
        b: a (K, N) tensor of a's dtype.
        mac: the arithmetic; the native MAC() is torch.matmul itself.
        seed, offset: the random stream of a stochastic rule (seed None: drawn from torch's
            default CPU generator).

    Returns:
        c of shape (M, N), in a's dtype when the accumulator fits it, else float32 or float64.

    Raises:
        TypeError: an operand has an unsupported dtype (float64 products would not be exact), the
            dtypes differ, or mac is not a MAC.
        ValueError: the shapes do not match or an operand is not on the CPU.
    """
    if not isinstance(mac, MAC):
        raise TypeError(f"mac must be a MAC, got {type(mac).__name__}")
    check_product_operands(a, b, ("a", "b"), "lpsim.mac.matmul")
    if mac.native:
        return torch.matmul(a, b)
    for fmt in (mac.accumulator, mac.product, mac.chunk_accumulator):
        if fmt is not None:
            check_fits(fmt, torch.float64)
    out_dtype = fitting_container(mac.accumulator, a.dtype)
    acc = sum_grid(mac.accumulator, out_dtype)
    inner = sum_grid(mac.chunk_accumulator or mac.accumulator, torch.float64)
    product = sum_grid(mac.product, torch.float64) if mac.product is not None else acc
    rule, *random = _random_args(mac.rounding, mac.rbits, seed, offset)
    y = call(
        "mac_matmul",
        a.contiguous(),
        b.t().contiguous(),
        ORDER_CODES[mac.order],
        mac.chunk or 1,
        mac.compensated,
        mac.product is not None,
        *product,
        *inner,
        *acc,
        int(rule),
        *random,
    )
    return y.to(out_dtype)

"""The ops are well-formed torch custom ops: opcheck passes (schemas, fake kernels, autograd
registration), torch.compile(fullgraph=True) traces quantize and matches eager bit for bit."""

import pytest
import torch

import lpsim
from lpsim import BlockFloat, Fixed, Float
from support import assert_same_bits


def _grid_args(fmt, rule=0):
    return tuple(fmt.grid()) + (rule, 32, torch.tensor(5), 0)


@pytest.mark.parametrize("rule", [0, 8])
def test_opcheck_quantize_grid(rule):
    x = torch.randn(5, 7, requires_grad=True)
    torch.library.opcheck(torch.ops.lpsim.quantize_grid, (x,) + _grid_args(Float(5, 2), rule))
    y = torch.randn(5, 7)
    torch.library.opcheck(torch.ops.lpsim.quantize_grid_, (y,) + _grid_args(Fixed(8, 3), rule))
    torch.library.opcheck(torch.ops.lpsim.quantize_grid_out, (x.detach(),) + _grid_args(Float(4, 3), rule),
                          {"out": torch.empty(5, 7)})


@pytest.mark.parametrize("dim,block_size", [(None, None), (1, None), (None, 4)])
def test_opcheck_quantize_block(dim, block_size):
    x = torch.randn(6, 9, requires_grad=True)
    args = (6, dim, block_size, 8, 32, torch.tensor(3), 0)
    torch.library.opcheck(torch.ops.lpsim.quantize_block, (x,) + args)
    torch.library.opcheck(torch.ops.lpsim.quantize_block_, (torch.randn(6, 9),) + args)
    torch.library.opcheck(torch.ops.lpsim.quantize_block_out, (torch.randn(6, 9),) + args,
                          {"out": torch.empty(6, 9)})


def _model(x):
    h = lpsim.quantize(x * 2.0, Float(5, 2), "nearest")
    h = lpsim.quantize(torch.tanh(h), Fixed(8, 6), "stochastic", seed=17)
    return lpsim.quantize(h @ h.t(), BlockFloat(6, 0), "stochastic", seed=18, rbits=8)


def test_compiled_function_matches_eager_bit_for_bit():
    torch._dynamo.reset()
    x = torch.randn(16, 24)
    compiled = torch.compile(_model, fullgraph=True)
    assert_same_bits(compiled(x), _model(x))


def test_compiled_function_backward_is_straight_through():
    torch._dynamo.reset()

    def f(x):
        return (lpsim.quantize(x, Float(5, 2), "stochastic", seed=3) * 3.0).sum()

    x = torch.randn(8, 5, requires_grad=True)
    torch.compile(f, fullgraph=True)(x).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_compiled_unseeded_stochastic_rounding_traces():
    torch._dynamo.reset()

    def f(x):
        return lpsim.quantize(x, Float(5, 2), "stochastic")

    y = torch.compile(f, fullgraph=True)(torch.full((1000,), 1.1))
    assert set(y.unique().tolist()) <= {1.0, 1.25}

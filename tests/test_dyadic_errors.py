"""Bad input to lpsim.dyadic raises a clear exception naming the parameter and its allowed range,
and the docstring examples of the package run as written."""

import doctest
import math
import warnings

import pytest
import torch

import lpsim.dyadic
import lpsim.dyadic.functional
import lpsim.dyadic.tensor
from lpsim import dyadic
from lpsim.dyadic import DyadicTensor
from lpsim.dyadic import nn as inn
from lpsim.dyadic.optim import SGD

V = torch.tensor([1, 2, 3], dtype=torch.int32)
X = DyadicTensor(V, 0)
M = DyadicTensor(torch.ones(2, 3, dtype=torch.int32), 0)


def _after_forward(module):
    module(M)
    return module


def _columns(x: DyadicTensor) -> DyadicTensor:
    """x's mantissa with one scale per column (axis 1)."""
    return DyadicTensor(x.mantissa, list(range(x.shape[1])), 1)


def _step_with_grad(grad):
    p = inn.Parameter("w", X, 8, grad=grad)
    SGD([p], lr_shift=1).step()


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (
            lambda: DyadicTensor(torch.ones(3), 0),
            TypeError,
            r"mantissa must be an int32 or int64 tensor, got torch.float32",
        ),
        (lambda: DyadicTensor([1, 2], 0), TypeError, r"mantissa must be a torch.Tensor"),
        (
            lambda: DyadicTensor(V, 2**31),
            ValueError,
            r"scale must be in \[-2\*\*30, 2\*\*30\], got",
        ),
        (lambda: DyadicTensor(V, 1.5), TypeError, r"scale must be an int, got float"),
        (
            lambda: dyadic.from_float(torch.ones(3), 8, [1, 2, 3]),
            TypeError,
            r"scale must be an int, got list: a per-channel scale needs axis=",
        ),
        (
            lambda: DyadicTensor(V, torch.tensor([1, 2, 3])),
            TypeError,
            r"scale must be an int, got Tensor: a per-channel scale needs axis=",
        ),
        (
            lambda: DyadicTensor(V, [1, 2], axis=0),
            ValueError,
            r"a per-channel scale along axis 0 needs 3 entries, got 2",
        ),
        (
            lambda: DyadicTensor(V, [1.0, 2.0, 3.0], axis=0),
            TypeError,
            r"a per-channel scale must hold integers",
        ),
        (
            lambda: DyadicTensor(V, [1, 2, 3], axis=1),
            IndexError,
            r"axis must be in \[-1, 0\] for a tensor of 1 dimensions, got 1",
        ),
        (lambda: dyadic.requantize(X, 0, 1), ValueError, r"bits must be in \[2, 64\], got 1"),
        (
            lambda: dyadic.requantize(X, 0, 64, signed=False),
            ValueError,
            r"bits must be in \[1, 63\], got 64",
        ),
        (lambda: dyadic.requantize(X, 0, 8, signed=1), TypeError, r"signed must be a bool"),
        (lambda: dyadic.requantize(X, 0, 8.0), TypeError, r"bits must be an int, got float"),
        (
            lambda: dyadic.requantize(X, 0, 8, rounding="nearest_away"),
            ValueError,
            r"rounding must be one of 'nearest', 'down', 'stochastic' for dyadic operations; got "
            r"'nearest_away'",
        ),
        (
            lambda: dyadic.requantize(X, 0, 8, rounding="nearest", rbits=4),
            ValueError,
            r"rbits applies to the stochastic rules only",
        ),
        (
            lambda: dyadic.requantize(X, 0, 8, rbits=33),
            ValueError,
            r"rbits must be in \[1, 32\], got 33",
        ),
        (
            lambda: dyadic.requantize(X, 0, 8, seed=-1),
            ValueError,
            r"seed must be in \[0, 2\*\*64\)",
        ),
        (
            lambda: dyadic.requantize(X, 0, 40, dtype=torch.int32),
            ValueError,
            r"the range \[-549755813888, 549755813887\] does not fit torch.int32",
        ),
        (
            lambda: dyadic.requantize(X, 0, 8, dtype=torch.int16),
            TypeError,
            r"dtype must be torch.int32 or torch.int64",
        ),
        (
            lambda: dyadic.requantize(X, [0, 1, 2], 8),
            ValueError,
            r"a per-channel target scale needs axis=",
        ),
        (
            lambda: dyadic.requantize(X, 3, 8, axis=7),
            ValueError,
            r"axis= goes with a per-channel target scale; got axis=7 with one scale \(3\)",
        ),
        (
            lambda: dyadic.requantize(X, 3, 8, axis=0),
            ValueError,
            r"axis= goes with a per-channel target scale; got axis=0",
        ),
        (
            lambda: dyadic.requantize(
                DyadicTensor(torch.ones(2, 2, dtype=torch.int32), [0, 0], 0), [0, 0], 8, axis=1
            ),
            ValueError,
            r"x's scale runs along axis 0, the target's along 1",
        ),
        (lambda: dyadic.mul(X, X, -1), ValueError, r"shift must be in \[0, 1073741824\], got -1"),
        (lambda: dyadic.div(X, X, 32), ValueError, r"shift must be in \[0, 31\], got 32"),
        (
            lambda: dyadic.div(DyadicTensor(V.long(), 0), X, 64),
            ValueError,
            r"shift must be in \[0, 63\], got 64",
        ),
        (
            lambda: dyadic.div(X, DyadicTensor(torch.tensor([1, 0, 0], dtype=torch.int32), 0), 0),
            ZeroDivisionError,
            r"b is 0 in 2 element\(s\)",
        ),
        (lambda: dyadic.add(X, V), TypeError, r"b must be a DyadicTensor, got Tensor"),
        (
            lambda: dyadic.add(X, X, overflow="wrap"),
            ValueError,
            r"overflow must be 'raise' or 'saturate', got 'wrap'",
        ),
        (
            lambda: dyadic.add(
                DyadicTensor(torch.ones(2, 2, dtype=torch.int32), [0, 1], 0),
                DyadicTensor(torch.ones(2, 2, dtype=torch.int32), [0, 1], 1),
            ),
            ValueError,
            r"a's scale runs along dimension 0 of the result and b's along 1",
        ),
        (
            lambda: dyadic.matmul(M, M),
            ValueError,
            r"matmul needs \(N, K\) and \(K, M\) tensors, "
            r"got \(2, 3\) and \(2, 3\)",
        ),
        (
            lambda: dyadic.matmul(DyadicTensor(M.mantissa, [0, 1, 2], 1), M.t()),
            ValueError,
            r"per-channel scale along the summed dimension",
        ),
        (
            lambda: dyadic.matmul(M, M.t(), accumulator_bits=65),
            ValueError,
            r"^accumulator_bits must be in \[2, 64\], got 65",
        ),
        (lambda: dyadic.sum(M, 2), ValueError, r"dim must be in \[-2, 1\], got 2"),
        (lambda: dyadic.sum(X, 0), ValueError, r"sum needs a 2-D tensor, got 1 dimensions"),
        (
            lambda: dyadic.from_float(torch.tensor([1.0, float("nan")]), 8),
            ValueError,
            r"x must be finite, found 1 NaN or Inf",
        ),
        (
            lambda: dyadic.from_float(torch.tensor([1, 2]), 8),
            TypeError,
            r"x must be a floating tensor, got torch.int64",
        ),
        (
            lambda: dyadic.from_float(torch.ones(2, 2), 8, axis=2),
            IndexError,
            r"axis must be in \[-2, 1\] for a tensor of 2 dimensions, got 2",
        ),
        (lambda: dyadic.fit_shift(V, 8), TypeError, r"x must be a DyadicTensor"),
        (lambda: X.ldexp(1.0), TypeError, r"exponent must be an int"),
        (
            lambda: X.to_float(torch.int32),
            TypeError,
            r"dtype must be torch.float32, float64, float16 or bfloat16, got torch.int32",
        ),
        (
            lambda: X.to_float(torch.float8_e4m3fn),
            TypeError,
            r"dtype must be torch.float32, float64, float16 or bfloat16, got torch.float8_e4m3fn",
        ),
        (
            lambda: inn.Linear(4, 3, weight_bits=40),
            ValueError,
            r"weight_bits must be in \[2, 32\], got 40",
        ),
        (
            lambda: inn.Linear(2, 2, bias=False, bias_value=torch.tensor([5.0, 5.0])),
            ValueError,
            r"bias_value is the initial bias of a layer with bias=True; got one with bias=False",
        ),
        (
            lambda: inn.Linear(4, 3, accumulator_bits=1),
            ValueError,
            r"accumulator_bits must be in \[2, 64\], got 1",
        ),
        (
            lambda: inn.Linear(4, 3, forward_shift=-1),
            ValueError,
            r"forward_shift must be None \(dynamic\) or an int in \[0, 2\*\*31\], got -1",
        ),
        (lambda: inn.Linear(4, 3, rounding="up"), ValueError, r"rounding must be one of"),
        (
            lambda: inn.Linear(4, 3, weight=torch.ones(4, 3)),
            ValueError,
            r"weight must have shape \(3, 4\), got \(4, 3\)",
        ),
        (lambda: inn.Linear(3, 2)(M.t()), ValueError, r"x must be \(N, 3\) with one scale"),
        (lambda: inn.Linear(3, 2)(M.mantissa), TypeError, r"x must be a DyadicTensor"),
        (
            lambda: inn.Sequential(torch.nn.ReLU()),
            TypeError,
            r"Sequential takes lpsim.dyadic.nn modules, got ReLU",
        ),
        (
            lambda: inn.mse_loss(M, M.t()),
            ValueError,
            r"output and target must be \(N, C\) of one shape",
        ),
        (
            lambda: dyadic.scale_for(torch.tensor([1.0, math.nan]), 8),
            ValueError,
            r"x must be finite, found NaN or Inf",
        ),
        (lambda: dyadic.scale_for([1.0], 8), TypeError, r"x must be a torch.Tensor, got list"),
        (
            lambda: dyadic.scale_for(torch.tensor([3.0 + 4.0j]), 8),
            TypeError,
            r"x must be a real floating or integer tensor, got torch.complex64",
        ),
        (
            lambda: dyadic.scale_for(torch.tensor([True]), 8),
            TypeError,
            r"x must be a real floating or integer tensor, got torch.bool",
        ),
        (lambda: dyadic.requantize(M, 1.0, 8), TypeError, r"scale must be an int, got float"),
        (lambda: _after_forward(inn.Linear(3, 2)).backward(5), TypeError, r"grad must be a Dy"),
        (lambda: inn.ReLU()(M.mantissa), TypeError, r"x must be a DyadicTensor, got Tensor"),
        (
            lambda: inn.Linear(2, 2, weight=torch.full((2, 2), math.nan)),
            ValueError,
            r"weight must be finite, found 4 NaN or Inf",
        ),
        (
            lambda: inn.Linear(2, 2, bias_value=torch.tensor([0.5, math.inf])),
            ValueError,
            r"bias_value must be finite, found 1 NaN or Inf",
        ),
        (
            lambda: inn.Linear(2, 2, weight=torch.ones(2, 2, dtype=torch.int32)),
            TypeError,
            r"weight must be a floating tensor, got torch.int32",
        ),
        (
            lambda: inn.Linear(2, 2, weight=[[1.0, 0.0], [0.0, 1.0]]),
            TypeError,
            r"weight must be a torch.Tensor, got list",
        ),
        (
            lambda: _after_forward(inn.ReLU()).backward(M.t()),
            ValueError,
            r"grad must have the output's shape \(2, 3\), got \(3, 2\)",
        ),
        (lambda: inn.mse_loss(M.mantissa, M), TypeError, r"output must be a DyadicTensor"),
        (lambda: inn.mse_loss(M, M.mantissa), TypeError, r"target must be a DyadicTensor"),
        (
            lambda: _step_with_grad(torch.ones(3)),
            TypeError,
            r"the gradient of 'w' must be a DyadicTensor, got Tensor",
        ),
        (
            lambda: SGD([inn.Parameter("w", V, 8, grad=X)], lr_shift=1).step(),
            TypeError,
            r"^the value of 'w' must be a DyadicTensor, got Tensor$",
        ),
        (
            lambda: SGD(
                [inn.Parameter("w", DyadicTensor(M.mantissa, [0, 1], 0), 8, grad=_columns(M))],
                lr_shift=1,
            ).step(),
            ValueError,
            r"^the gradient of 'w' has its scales along axis 1, its value along axis 0",
        ),
        (
            lambda: SGD([inn.Parameter("w", X, 8)], lr_shift=1).load_state_dict(
                {
                    "momentum": [{"mantissa": [1, 2, 3], "scale": 0, "axis": None}],
                    "stats": [{"gradient": 0, "weight": 0}],
                }
            ),
            ValueError,
            r"^the momentum buffer of 'w' must be an int32 tensor of shape \(3,\), got list$",
        ),
        (lambda: SGD([1], lr_shift=1), TypeError, r"parameters must be lpsim.dyadic.nn.Parameter"),
        (lambda: SGD([], lr_shift=63), ValueError, r"lr_shift must be in \[0, 62\], got 63"),
        (
            lambda: SGD([], lr_shift=7, momentum_shift=31),
            ValueError,
            r"momentum_shift must be in \[0, 30\], got 31",
        ),
        (
            lambda: SGD([], lr_shift=7, grad_bits=1),
            ValueError,
            r"grad_bits must be in \[2, 32\], got 1",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda bits: dyadic.matmul(M, M.t(), accumulator_bits=bits),
        lambda bits: dyadic.saturating_matmul(M, M.t(), accumulator_bits=bits),
        lambda bits: dyadic.sum(M, 0, accumulator_bits=bits),
        lambda bits: dyadic.saturating_sum(M, 1, accumulator_bits=bits),
        lambda bits: inn.mse_loss(M, M, accumulator_bits=bits),
    ],
)
def test_an_accumulator_width_out_of_range_is_named_accumulator_bits(call):
    for bits in (1, 65):
        with pytest.raises(
            ValueError, match=rf"^accumulator_bits must be in \[2, 64\], got {bits}"
        ):
            call(bits)
    with pytest.raises(TypeError, match=r"^accumulator_bits must be an int, got str"):
        call("32")


def test_ldexp_past_the_scale_range_names_exponent_and_its_range():
    per_tensor = DyadicTensor(V, 3)
    per_channel = DyadicTensor(V, [3, -5, 0], axis=0)
    assert per_tensor.ldexp(2**30 + 3).scale == -(2**30)
    assert per_channel.ldexp(-(2**30) + 3).scale.tolist() == [2**30, 2**30 - 8, 2**30 - 3]
    cases = [
        (
            per_tensor,
            2**30 + 4,
            r"exponent 1073741828 moves the scale 3 out of \[-2\*\*30, 2\*\*30\]",
        ),
        (per_tensor, -(2**30) + 2, r"exponent must be in \[-1073741821, 1073741827\]"),
        (per_channel, 2**30 - 4, r"moves the scale \[3, -5, 0\] out of"),
        (per_channel, 2**100, r"exponent must be in \[-1073741821, 1073741819\]"),  # no wrap
        (per_channel, -(2**64), r"exponent must be in \[-1073741821, 1073741819\]"),
    ]
    for x, exponent, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            x.ldexp(exponent)


def test_a_result_scale_past_the_range_names_the_operation_and_its_formula():
    top = DyadicTensor(V, 2**30)
    one = DyadicTensor(torch.ones(1, 1, dtype=torch.int32), 2**30)
    cases = [
        (lambda: dyadic.mul(top, top), r"^lpsim\.dyadic\.mul: the result's scale s_a \+ s_b - "),
        (lambda: dyadic.div(top, DyadicTensor(V, -(2**30)), 0), r"^lpsim\.dyadic\.div: the "),
        (
            lambda: dyadic.matmul(one, DyadicTensor(torch.ones(1, 1, dtype=torch.int32), [1], 1)),
            r"^lpsim\.dyadic\.matmul: the result's scale s_a \+ s_b = \[1073741825\] is outside",
        ),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
    # At the ends of the range itself the results are exact: 1 * 1 at scale 2**30.
    edge = dyadic.mul(top, DyadicTensor(V, 0), 0)
    assert edge.scale == 2**30 and edge.mantissa.tolist() == [1, 4, 9]


def test_kernels_reject_bad_arguments_from_direct_calls():
    ops = torch.ops.lpsim
    seed = torch.tensor(0)
    with pytest.raises(RuntimeError, match="dyadic ops round by nearest, down or stochastic"):
        ops.dyadic_requantize(V, [0], 3, -128, 127, torch.int32, 1, 32, seed, 0)
    with pytest.raises(RuntimeError, match="must contain 0 and fit"):
        ops.dyadic_requantize(V, [0], 3, 1, 127, torch.int32, 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match="do not tile a tensor of 3 elements"):
        ops.dyadic_requantize(V, [0, 0], 1, -128, 127, torch.int32, 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match="alignment shifts must be >= 0 with one of each pair 0"):
        ops.dyadic_add(V, V, [1], [2], 3, False, 0, 32, seed, 0)
    with pytest.raises(ValueError, match="division by zero in 3 elements"):
        ops.dyadic_div(V, torch.zeros_like(V), 0, 0, 32, seed, 0)


@pytest.mark.parametrize(
    "module", [lpsim.dyadic, lpsim.dyadic.tensor, lpsim.dyadic.functional], ids=lambda m: m.__name__
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "call",
    [
        lambda rule: dyadic.requantize(X, 0, 8, rounding=rule),
        lambda rule: dyadic.from_float(torch.tensor([1.0, 2.5]), 8, rounding=rule),
        lambda rule: dyadic.add(X, X, rounding=rule),
        lambda rule: dyadic.align(X, X, rounding=rule),
        lambda rule: dyadic.mul(X, X, rounding=rule),
        lambda rule: dyadic.div(X, X, 1, rounding=rule),
        lambda rule: inn.Linear(3, 2, rounding=rule),
        lambda rule: SGD([], lr_shift=7, rounding=rule),
    ],
    ids=["requantize", "from_float", "add", "align", "mul", "div", "Linear", "SGD"],
)
@pytest.mark.parametrize("rule", ["stochastc", "nearest_away", lpsim.Rounding.odd])
def test_a_bad_rounding_name_lists_only_the_rules_dyadic_accepts(call, rule):
    with pytest.raises(ValueError) as raised:
        call(rule)
    got = rule.name if isinstance(rule, lpsim.Rounding) else rule
    assert str(raised.value) == (
        "rounding must be one of 'nearest', 'down', 'stochastic' for "
        f"dyadic operations; got {got!r}"
    )


@pytest.mark.parametrize("bad", [-(2**63), -(2**31), 2**31, 2**63 - 1])
def test_a_per_channel_scale_out_of_range_is_refused_at_either_end(bad):
    # -2**63 has no int64 magnitude (abs wraps to itself): it must be refused like any scale
    # outside [-2**30, 2**30], not kept to read 2**(2**63) as 0.
    with pytest.raises(ValueError, match=rf"scale must be in \[-2\*\*30, 2\*\*30\], got {bad}$"):
        DyadicTensor(torch.ones(2, dtype=torch.int32), torch.tensor([bad, 0]), axis=0)
    with pytest.raises(ValueError, match=rf"scale must be in \[-2\*\*30, 2\*\*30\], got {bad}$"):
        dyadic.from_float(torch.ones(2), 8, torch.tensor([0, bad]), axis=0)


def _nested(dtype: torch.dtype) -> torch.Tensor:
    """A nested tensor of two vectors of ``dtype`` (whose layout is torch.strided)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype stage of nested tensors
        return torch.nested.nested_tensor([torch.ones(2, dtype=dtype), torch.ones(3, dtype=dtype)])


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (
            lambda: dyadic.from_float(torch.tensor([1.0, 0.0, 2.5]).to_sparse(), 8, 2),
            TypeError,
            r"^x is a sparse_coo tensor; lpsim.dyadic.from_float takes dense \(strided\) tensors$",
        ),
        (
            lambda: dyadic.from_float(torch.ones(3, device="meta"), 8),
            ValueError,
            r"^x must be a CPU tensor \(lpsim.dyadic.from_float runs on the CPU\), got one on meta",
        ),
        (
            lambda: DyadicTensor(torch.tensor([1, 0], dtype=torch.int32).to_sparse(), 0),
            TypeError,
            r"^mantissa is a sparse_coo tensor; DyadicTensor takes dense \(strided\) tensors$",
        ),
        (
            lambda: inn.Linear(3, 1, weight=torch.ones(1, 3).to_sparse()),
            TypeError,
            r"^weight is a sparse_coo tensor; lpsim.dyadic.nn.Linear takes dense \(strided\)",
        ),
        (
            lambda: inn.Linear(3, 1, bias_value=torch.ones(1, device="meta")),
            ValueError,
            r"^bias_value must be a CPU tensor \(lpsim.dyadic.nn.Linear runs on the CPU\)",
        ),
        # These raised from inside torch: "Could not run 'aten::ne.Scalar' with arguments from
        # the 'NestedTensorCPU' backend", "NestedTensorImpl doesn't support sizes", "Could not
        # run 'aten::amax' ... 'SparseCPU' backend", "Tensor.item() cannot be called on meta
        # tensors".
        (
            lambda: dyadic.from_float(_nested(torch.float32), 8),
            TypeError,
            r"^x is a nested tensor; lpsim.dyadic.from_float takes dense \(strided\) tensors$",
        ),
        (
            lambda: DyadicTensor(_nested(torch.int32), 0),
            TypeError,
            r"^mantissa is a nested tensor; DyadicTensor takes dense \(strided\) tensors$",
        ),
        (
            lambda: dyadic.scale_for(torch.tensor([1.0, 0.0, 2.5]).to_sparse(), 8),
            TypeError,
            r"^x is a sparse_coo tensor; lpsim.dyadic.scale_for takes strided tensors",
        ),
        (
            lambda: dyadic.scale_for(_nested(torch.float32), 8),
            TypeError,
            r"^x is a nested tensor; lpsim.dyadic.scale_for takes strided tensors",
        ),
        (
            lambda: dyadic.scale_for(torch.ones(3, device="meta"), 8),
            ValueError,
            r"^x is a meta tensor, which holds no values",
        ),
    ],
)
def test_a_sparse_or_non_cpu_tensor_is_refused_by_name(call, error, pattern):
    # The integer kernels read dense CPU storage: other tensors are refused up front, by the
    # parameter's name, not by an error from inside torch (or a sparse mantissa kept as a value).
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_a_one_element_scale_tensor_must_hold_an_integer(dtype):
    # As scale=True and scale=1.0 are refused, so are 0-d bool, float and complex tensors (a bool
    # one was read as the scale 1, a float one was refused as if it were per channel).
    with pytest.raises(TypeError, match=rf"^scale must be an int, got a {dtype} tensor$"):
        DyadicTensor(torch.ones(2, dtype=torch.int32), torch.tensor(1, dtype=dtype))
    assert DyadicTensor(torch.ones(2, dtype=torch.int32), torch.tensor(3)).scale == 3


@pytest.mark.parametrize(
    ("scale", "error", "pattern"),
    [
        ([True, 2], TypeError, r"^a per-channel scale must hold integers, got bool$"),
        ([1.0, 2], TypeError, r"^a per-channel scale must hold integers, got float$"),
        ([None, 2], TypeError, r"^a per-channel scale must hold integers, got NoneType$"),
        (
            [2**63, 1],
            ValueError,
            r"^scale must be in \[-2\*\*30, 2\*\*30\], got 9223372036854775808$",
        ),
    ],
)
def test_each_entry_of_a_per_channel_scale_list_is_checked(scale, error, pattern):
    # A list's entries are scales: True is refused as scale=True is (not read as 1), and an entry
    # beyond int64 is out of range (not an error from converting the list to a tensor).
    with pytest.raises(error, match=pattern):
        DyadicTensor(torch.ones(2, dtype=torch.int32), scale, axis=0)

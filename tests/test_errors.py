"""Bad input raises a clear exception that names the parameter and the allowed range: never a
crash, a hang, or silently wrong numbers."""

import pytest
import torch

import lpsim
import lpsim.compat.qtorch
from lpsim import BlockFloat, Float, Rounding

X = torch.randn(4, 3)


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (
            lambda: lpsim.quantize(torch.arange(4), Float(5, 2)),
            TypeError,
            r"x must be a float32, float64, bfloat16 or float16 tensor, got torch.int64",
        ),
        (
            lambda: lpsim.quantize(torch.ones(3, dtype=torch.bool), Float(5, 2)),
            TypeError,
            r"got torch.bool",
        ),
        (
            lambda: lpsim.quantize(torch.ones(3, dtype=torch.complex64), Float(5, 2)),
            TypeError,
            r"got torch.complex64",
        ),
        (
            lambda: lpsim.quantize(torch.ones(3).to(torch.float8_e5m2), Float(3, 1)),
            TypeError,
            r"got torch.float8_e5m2",
        ),
        (lambda: lpsim.quantize([1.0, 2.0], Float(5, 2)), TypeError, r"x must be a torch.Tensor"),
        (
            lambda: lpsim.quantize(X, "e5m2"),
            TypeError,
            r"fmt must be a Float, Fixed, P3109, BlockFloat or Scaled",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "round"),
            ValueError,
            r"rounding must be one of 'nearest', .*'stochastic_equal'; got 'round'",
        ),
        (lambda: lpsim.quantize(X, Float(5, 2), 3), TypeError, r"rounding must be a str"),
        # a Quantizer's rules are checked also where no format uses them, under their own names
        (
            lambda: lpsim.nn.Quantizer(None, None, "foo"),
            ValueError,
            r"forward_rounding must be one of 'nearest'.*got 'foo'",
        ),
        (
            lambda: lpsim.nn.quantizer(None, Float(5, 2), "nearst"),
            ValueError,
            r"forward_rounding must be one of .*got 'nearst'",
        ),
        (
            lambda: lpsim.nn.Quantizer(Float(5, 2), None, "nearest", 3),
            TypeError,
            r"backward_rounding must be a str",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", rbits=0),
            ValueError,
            r"rbits must be in \[1, 32\], got 0",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", rbits=33),
            ValueError,
            r"rbits must be in \[1, 32\], got 33",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", rbits=4.0),
            TypeError,
            r"rbits must be an int",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "nearest", rbits=4),
            ValueError,
            r"rbits applies to the stochastic rules only",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", seed=-1),
            ValueError,
            r"seed must be in \[0, 2\*\*64\)",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", seed=2**64),
            ValueError,
            r"seed must be in \[0, 2\*\*64\)",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", seed="1"),
            TypeError,
            r"seed must be an int or None",
        ),
        (  # a rule without random words ignores a seed, but not a malformed one
            lambda: lpsim.quantize(X, Float(5, 2), "nearest", seed="1"),
            TypeError,
            r"seed must be an int or None",
        ),
        (
            lambda: lpsim.quantize(X, BlockFloat(8), "down", seed=-1),
            ValueError,
            r"seed must be in \[0, 2\*\*64\)",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), "stochastic", seed=1, offset=-2),
            ValueError,
            r"offset must be in \[0, 2\*\*64\)",
        ),
        (
            lambda: lpsim.quantize(X, BlockFloat(8, 2)),
            IndexError,
            r"BlockFloat.dim must be in \[0, 1\] for a tensor of 2 dimensions, got 2",
        ),
        (
            lambda: BlockFloat(8, -1),
            ValueError,
            r"BlockFloat.dim must be None .* or a dimension >= 0, got -1: "
            r"negative dims are ambiguous",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), out=torch.empty(3, 4)),
            RuntimeError,
            r"out must have the shape of x",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), out=torch.empty(4, 3, dtype=torch.float64)),
            RuntimeError,
            r"out must have the dtype of x",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), out=X.numpy()),
            TypeError,
            r"out must be a torch.Tensor",
        ),
        (
            lambda: lpsim.quantize(X.half(), Float(8, 7)),
            ValueError,
            r"does not fit a float16 tensor",
        ),
        (lambda: Rounding.parse(None), TypeError, r"rounding must be a str"),
        (  # a truthy string meant as "off" once turned the clip mask on
            lambda: lpsim.nn.quantizer(Float(4, 3), clamp_grad_zero="no"),
            TypeError,
            r"clamp_grad_zero must be a bool, got str",
        ),
        (
            lambda: lpsim.nn.Quantizer(Float(4, 3), clamp_grad_zero=1),
            TypeError,
            r"clamp_grad_zero must be a bool, got int",
        ),
        (  # once accepted, and a TypeError only in backward
            lambda: lpsim.nn.quantizer(None, Float(4, 3), backward_hooks=[5]),
            TypeError,
            r"backward_hooks\[0\] must be callable, got int",
        ),
        (
            lambda: lpsim.compat.qtorch.quant.quantizer(
                lpsim.compat.qtorch.FixedPoint(4, 2), clamping_grad_zero="no"
            ),
            TypeError,
            r"clamping_grad_zero must be a bool, got str",
        ),
        # Sparse operands: the message names the operand (it was "unsupported memory format
        # option Contiguous" or "reshape is not implemented for sparse tensors").
        (
            lambda: lpsim.accumulate.sum(X.to_sparse()),
            TypeError,
            r"^x is a sparse_coo tensor; lpsim.accumulate takes strided tensors",
        ),
        (
            lambda: lpsim.accumulate.cumsum(X.to_sparse(), 0),
            TypeError,
            r"^x is a sparse_coo tensor; lpsim.accumulate takes strided tensors",
        ),
        (
            lambda: lpsim.accumulate.matvec(X, torch.ones(3).to_sparse()),
            TypeError,
            r"^x is a sparse_coo tensor; lpsim.accumulate takes strided tensors",
        ),
        (
            lambda: lpsim.accumulate.matmul(X, X.t().to_sparse()),
            TypeError,
            r"^b is a sparse_coo tensor; lpsim.accumulate takes strided tensors",
        ),
        (
            lambda: lpsim.mac.matmul(X.to_sparse(), X.t(), lpsim.MAC(accumulator=Float(5, 10))),
            TypeError,
            r"^a is a sparse_coo tensor; lpsim.mac.matmul under a non-native MAC takes strided",
        ),
        (
            lambda: lpsim.RandomHadamard(2, axis=0).apply(X.to_sparse()),
            TypeError,
            r"^x is a sparse_coo tensor; RandomHadamard takes strided tensors",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    "fmt",
    [lpsim.Float(4, 3), BlockFloat(8), lpsim.scaled.preset("mxfp8_e4m3")],
    ids=["float", "block", "scaled"],
)
def test_out_overlapping_x_in_part_is_refused_and_out_x_itself_is_exact(fmt):
    # An out= that shares part of x's memory once gave wrong values silently (the kernels read
    # elements already written); torch's own out= ops refuse it, and so does lpsim.
    buf = torch.randn(96)
    x, out = buf[:64].view(2, 32), buf[32:].view(2, 32)
    want = lpsim.quantize(x.clone(), fmt)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        lpsim.quantize(x, fmt, out=out)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        lpsim.quantize(x, fmt, out=x.view(32, 2).t())  # x's memory in another order
    assert torch.equal(lpsim.quantize(x, fmt, out=x), want)


def test_the_ops_check_their_arguments_when_called_directly():
    ops = torch.ops.lpsim
    seed = torch.tensor(0)
    grid = lpsim.Float(5, 2).grid()  # keep 2, qmin -16, emin -14, limits 57344, Inf, +/-0
    args = tuple(grid)
    with pytest.raises(RuntimeError, match=r"rounding code must be in \[0, 10\)"):
        ops.quantize_grid(X, *args, 10, 32, seed, 0)
    with pytest.raises(RuntimeError, match=r"rbits must be in \[1, 32\]"):
        ops.quantize_grid(X, *args, 8, 0, seed, 0)
    with pytest.raises(RuntimeError, match="seed must be a one-element int64 CPU tensor"):
        ops.quantize_grid(X, *args, 8, 32, torch.tensor(0.5), 0)
    with pytest.raises(RuntimeError, match="largest values are not representable"):
        ops.quantize_grid(X, *grid._replace(pos_limit=1.0 + 2.0**-30), 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match="smallest spacing is not representable"):
        ops.quantize_grid(X, *grid._replace(qmin=-200), 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match=r"wl must be in \[2, 25\] for a Float container"):
        ops.quantize_block(X, 26, None, None, 0, 32, seed, 0)
    with pytest.raises(IndexError, match="dim 2 does not exist"):
        ops.quantize_block(X, 8, 2, None, 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match="block_size must be >= 1"):
        ops.quantize_block(X, 8, None, 0, 0, 32, seed, 0)
    with pytest.raises(RuntimeError, match="give dim or block_size, not both"):
        ops.quantize_block(X, 8, 0, 4, 0, 32, seed, 0)
    with pytest.raises(TypeError, match="x must be a float32, float64, bfloat16 or float16"):
        ops.quantize_grid(torch.arange(3), *args, 0, 32, seed, 0)


def test_import_without_the_built_extension_names_the_build_command():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['lpsim._C'] = None\n"
        "try:\n    import lpsim\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install --no-build-isolation -e ." in out.stdout, out.stdout + out.stderr


def _nested():
    return torch.nested.nested_tensor([torch.ones(32), torch.ones(32)], layout=torch.jagged)


@pytest.mark.parametrize(
    "call,pattern",
    [
        # These reached the compiled ops, whose dispatcher raised "Could not run
        # 'lpsim::quantize_grid' with arguments from the 'SparseCsrCPU' backend" (or
        # 'NestedTensorCPU', 'MkldnnCPU'), or torch's "Internal error: NestedTensorImpl doesn't
        # support sizes", naming no argument.
        (lambda: lpsim.quantize(X.to_sparse_csr(), Float(5, 2)), r"^x is a sparse_csr tensor"),
        (lambda: lpsim.quantize(X.to_sparse(), Float(5, 2)), r"^x is a sparse_coo tensor"),
        (lambda: lpsim.quantize_(X.to_sparse(), BlockFloat(8)), r"^x is a sparse_coo tensor"),
        (lambda: lpsim.quantize(X.to_mkldnn(), Float(5, 2)), r"^x is a mkldnn tensor; .*to_dense"),
        (lambda: lpsim.quantize(_nested(), Float(5, 2)), r"^x is a nested tensor; .*unbind"),
        (
            lambda: lpsim.quantize(_nested(), lpsim.scaled.preset("mxfp8_e4m3"), "stochastic"),
            r"^x is a nested tensor",
        ),
        (
            lambda: lpsim.quantize(X, Float(5, 2), out=X.clone().to_sparse()),
            r"^out is a sparse_coo tensor",
        ),
        (lambda: lpsim.sr_add(torch.ones(2, 32), _nested()), r"^b is a nested tensor"),
        (lambda: lpsim.quantize_many_([_nested()], Float(5, 2)), r"^tensors\[0\] is a nested"),
        (lambda: lpsim.accumulate.sum(_nested()), r"^x is a nested tensor"),
        (
            lambda: lpsim.mac.matmul(_nested(), torch.ones(32, 3), lpsim.MAC(Float(5, 10))),
            r"^a is a nested tensor",
        ),
        (
            lambda: lpsim.statistics.quantize_with_statistics(_nested(), Float(5, 2)),
            r"^x is a nested tensor",
        ),
    ],
)
def test_non_strided_tensors_are_refused_by_name_everywhere(call, pattern):
    with pytest.raises(TypeError, match=pattern):
        call()


@pytest.mark.parametrize(
    "fmt",
    [Float(5, 2), BlockFloat(8), lpsim.scaled.preset("mxfp8_e4m3")],
    ids=["float", "block", "scaled"],
)
def test_statistics_of_a_meta_tensor_are_refused(fmt):
    # A meta tensor holds no values, and the statistics ops' shape-only kernels returned
    # uninitialised counts (elements=94178366295808, ...) as if they had been counted.
    x = torch.ones(4, 32, device="meta")
    with pytest.raises(ValueError, match="x is a meta tensor, which holds no values"):
        lpsim.statistics.quantize_with_statistics(x, fmt)
    with pytest.raises(ValueError, match="x is a meta tensor, which holds no values"):
        lpsim.statistics.rounding_statistics(x, x, fmt)


@pytest.mark.parametrize(
    "fields,error,pattern",
    [
        # "no" is truthy: the edge layers stayed in full precision, the weights were rounded.
        ({"keep_edges": "no"}, TypeError, r"Recipe.keep_edges must be a bool, got str"),
        ({"round_weights": "False"}, TypeError, r"Recipe.round_weights must be a bool, got str"),
        ({"keep_edges": 0}, TypeError, r"Recipe.keep_edges must be a bool, got int"),
        ({"mac": "fp16"}, TypeError, r"Recipe.mac must be a lpsim.MAC or None, got str"),
        ({"name": 5}, TypeError, r"Recipe.name must be a str, got int"),
    ],
)
def test_recipe_fields_of_the_wrong_type_are_refused_when_made(fields, error, pattern):
    with pytest.raises(error, match=pattern):
        lpsim.recipes.Recipe(**{"name": "r", "weight": Float(5, 2), **fields})


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        # "no" is truthy: it printed the report
        (
            lambda: lpsim.nn.inject(torch.nn.Linear(2, 2), {}, unmatched="ignore", verbose="no"),
            TypeError,
            r"^verbose must be a bool, got str",
        ),
        # AttributeError: 'int' object has no attribute 'modules' (or 'named_modules')
        (lambda: lpsim.nn.remove(5), TypeError, r"^model must be an nn.Module, got int"),
        (lambda: lpsim.nn.report("model"), TypeError, r"^model must be an nn.Module, got str"),
        (lambda: lpsim.nn.injected(None), TypeError, r"^model must be an nn.Module, got NoneType"),
        (
            lambda: lpsim.nn.quantized_parameters([]),
            TypeError,
            r"^model must be an nn.Module, got list",
        ),
        # TypeError: 'int' object is not iterable
        (
            lambda: lpsim.nn.Quantizer(Float(5, 2), backward_hooks=5),
            TypeError,
            r"^backward_hooks must be an iterable of functions tensor -> tensor, got int",
        ),
        (
            lambda: lpsim.nn.quantizer(Float(5, 2), backward_hooks=abs),
            TypeError,
            r"^backward_hooks must be an iterable of functions tensor -> tensor, got builtin",
        ),
        # TypeError: argument of type 'NoneType' is not iterable
        (lambda: lpsim.explore.parse_format(None), TypeError, r"^text must be a str, got NoneType"),
    ],
)
def test_model_and_setting_arguments_are_named_when_of_the_wrong_type(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_optimlp_names_the_parameter_whose_dtype_it_cannot_round():
    # The message was container_of's "x must be a float32, ... tensor, got torch.complex64",
    # naming an x the caller never gave.
    model = torch.nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(
        TypeError, match=r"^OptimLP weight: parameter 0 of group 0: the parameter is complex64"
    ):
        lpsim.optim.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), weight=Float(5, 10))


@pytest.mark.parametrize("mac", [lpsim.MAC(), lpsim.MAC(Float(5, 10))], ids=["native", "nearest"])
@pytest.mark.parametrize(
    "arguments,error,pattern",
    [
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
        ({"seed": 2**64}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"seed": "1"}, TypeError, r"seed must be an int or None, got str"),
        ({"offset": -1}, ValueError, r"offset must be in \[0, 2\*\*64\), got -1"),
        ({"offset": 1.0}, TypeError, r"offset must be an int, got float"),
    ],
)
def test_mac_matmul_checks_seed_and_offset_under_every_mac(mac, arguments, error, pattern):
    # The native MAC returned torch.matmul before the checks: any seed and offset passed.
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    with pytest.raises(error, match=pattern):
        lpsim.mac.matmul(a, b, mac, **arguments)
    assert torch.equal(lpsim.mac.matmul(a, b, mac, seed=2**64 - 1, offset=2**64 - 1), a @ b)


def test_delayed_scaler_refuses_a_record_that_is_not_a_bool_and_a_sparse_x():
    scaler = lpsim.DelayedScaling(lpsim.preset("e4m3fn"), history_length=4).scaler()
    scaler.eval()
    with pytest.raises(TypeError, match=r"^record must be a bool, got str"):
        scaler(torch.full((3,), 100.0), record="no")  # truthy: it entered the history
    assert torch.equal(scaler.amax_history, torch.zeros(4))
    assert torch.equal(scaler.scale, torch.tensor(1.0))
    # NotImplementedError: Could not run 'aten::clamp' with arguments from the 'SparseCPU' backend
    with pytest.raises(TypeError, match=r"^x is a sparse_coo tensor; DelayedScaler takes strided"):
        scaler(torch.ones(3).to_sparse())


def test_dyadic_modules_take_a_bool_training_mode():
    # torch.nn.Module.train refuses a mode that is not a bool; the dyadic modules stored any:
    # train("no") is truthy and switched on stochastic requantisation and the overflow counts.
    layers = [lpsim.dyadic.nn.Linear(2, 2), lpsim.dyadic.nn.ReLU()]
    for module in (*layers, lpsim.dyadic.nn.Sequential(*layers)):
        module.eval()
        with pytest.raises(TypeError, match=r"^mode must be a bool, got str"):
            module.train("no")
        assert module.training is False


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        # "no" is truthy: the layer got a bias
        (lambda: lpsim.dyadic.nn.Linear(2, 2, bias="no"), TypeError, r"^bias must be a bool"),
        # the message spoke of a scale ("scale must be in [-2**30, 2**30], got -1180...")
        # only in the first forward pass
        (
            lambda: lpsim.dyadic.nn.Linear(2, 2, forward_shift=2**70),
            ValueError,
            r"^forward_shift must be None \(dynamic\) or an int in \[0, 2\*\*31\]",
        ),
        (
            lambda: lpsim.dyadic.nn.Linear(2, 2, backward_shift=1.0),
            TypeError,
            r"^backward_shift must be None \(dynamic\) or an int, got float",
        ),
        # AttributeError: 'int' object has no attribute 'modules'
        (
            lambda: lpsim.compat.qtorch.lower(
                5, ["linear"], lpsim.compat.qtorch.FloatingPoint(5, 2)
            ),
            TypeError,
            r"^model must be an nn.Module, got int",
        ),
        (
            lambda: lpsim.compat.qtorch.sequential_lower("m", ["linear"]),
            TypeError,
            r"^model must be an nn.Module, got str",
        ),
        # registered the package in sys.modules under the key 5 or ""
        (lambda: lpsim.compat.qtorch.install(5), TypeError, r"^name must be a str, got int"),
        (lambda: lpsim.compat.qtorch.install(""), ValueError, r"^name must be a module name"),
        (lambda: lpsim.compat.qtorch.install("q torch"), ValueError, r"^name must be a module"),
    ],
)
def test_dyadic_layer_and_qtorch_arguments_are_checked_where_given(call, error, pattern):
    import sys

    modules = dict(sys.modules)
    with pytest.raises(error, match=pattern):
        call()
    assert sys.modules.keys() == modules.keys()


_MAC = lpsim.MAC(Float(5, 10))


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        # RuntimeError: reshape is not implemented for sparse tensors
        (
            lambda: lpsim.nn.functional.linear(X.to_sparse(), torch.ones(2, 3), mac=_MAC),
            TypeError,
            r"^linear: input is a sparse_coo tensor; a product under a non-native MAC takes",
        ),
        (
            lambda: lpsim.nn.functional.matmul(X, torch.ones(3, 2).to_sparse(), mac=_MAC),
            TypeError,
            r"^matmul: other is a sparse_coo tensor",
        ),
        # accepted silently where no format used the rule
        (
            lambda: lpsim.nn.functional.linear(X, torch.ones(2, 3), rounding="nearst"),
            ValueError,
            r"^rounding must be one of .*got 'nearst'",
        ),
    ],
)
def test_functional_products_check_their_operands_and_rule(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_functional_products_under_the_native_mac_take_sparse_operands_as_torch():
    w = torch.ones(2, 3)
    assert torch.equal(
        lpsim.nn.functional.linear(X.to_sparse(), w), torch.nn.functional.linear(X.to_sparse(), w)
    )


@pytest.mark.parametrize("fmt", [Float(5, 2), BlockFloat(8)], ids=["grid", "block"])
def test_quantize_many_names_the_leaf_that_requires_grad_for_every_format(fmt):
    # Float, Fixed and P3109 formats raised torch's "a leaf Variable that requires grad is being
    # used in an in-place operation.", which names no tensor of the list.
    a, leaf = torch.randn(5), torch.randn(3, requires_grad=True)
    before = a.clone()
    with pytest.raises(RuntimeError, match=r"^tensors\[1\] is a leaf Variable that requires grad"):
        lpsim.quantize_many_([a, leaf], fmt)
    assert torch.equal(a, before)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: lpsim.optim.FusedSGD(ps, lr=0.1, momentum=0.9, weight_format=Float(5, 10)),
        lambda ps: lpsim.optim.FusedAdam(ps, lr=0.1, weight_format=Float(5, 10)),
        lambda ps: lpsim.optim.SGD(ps, lr=0.1, momentum=0.9, weight_format=Float(5, 10)),
        lambda ps: lpsim.optim.AdamW(ps, lr=0.1, weight_format=Float(5, 10)),
    ],
    ids=["FusedSGD", "FusedAdam", "SGD", "AdamW"],
)
@pytest.mark.parametrize(
    "key,value,error,pattern",
    [
        # stepped on: a negative lr ascended, a NaN one wrote NaN into every weight
        ("lr", -1.0, ValueError, r"^lr must be in \[0.0, inf\], got -1.0"),
        ("lr", float("nan"), ValueError, r"^lr must be in \[0.0, inf\], got nan"),
        ("weight_decay", "x", TypeError, r"^weight_decay must be a number, got str"),
        # FusedSGD and FusedAdam: AttributeError: 'str' object has no attribute 'rounding'
        ("weight_format", "e5m2", TypeError, r"^weight_format must be"),
        # the fused optimizers never read it again, and stepped on
        ("rounding", "nearst", ValueError, r"^rounding must be one of .*got 'nearst'"),
    ],
)
def test_optimizers_check_a_group_option_set_after_the_group_was_made(
    make, key, value, error, pattern
):
    # torch's optimizers read a group's options at every step; these check them there as their
    # constructors do, before any parameter is written.
    torch.manual_seed(0)
    w = torch.nn.Parameter(lpsim.quantize(torch.randn(4), Float(5, 10)))
    opt = make([w])
    before = w.detach().clone()
    opt.param_groups[0][key] = value
    w.grad = torch.ones(4)
    with pytest.raises(error, match=pattern):
        opt.step()
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda ps: lpsim.optim.SGD(ps, lr=0.1, momentum=0.9), "nesterov"),
        (lambda ps: lpsim.optim.SGD(ps, lr=0.1), "kahan"),
        (lambda ps: lpsim.optim.AdamW(ps, lr=0.1), "kahan"),
        (lambda ps: lpsim.optim.FusedSGD(ps, lr=0.1, momentum=0.9), "nesterov"),
    ],
)
def test_optimizers_refuse_a_truthy_string_flag_set_on_a_group(make, key):
    # "no" is truthy: SGD stepped with Nesterov momentum or Kahan compensation
    w = torch.nn.Parameter(torch.ones(4))
    opt = make([w])
    opt.param_groups[0][key] = "no"
    w.grad = torch.ones(4)
    with pytest.raises(TypeError, match=rf"^{key} must be a bool, got str"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(4))


def test_a_fused_optimizer_takes_a_format_set_on_a_group_under_the_groups_rule():
    # The fused step raised AttributeError: 'Float' object has no attribute 'rounding'.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    opt = lpsim.optim.FusedSGD([w], lr=0.1, rounding="nearest")
    opt.param_groups[0]["weight_format"] = Float(5, 2)
    w.grad = torch.ones(8)
    want = lpsim.quantize(w.detach() - 0.1, Float(5, 2), "nearest")
    opt.step()
    assert torch.equal(w.detach(), want)


@pytest.mark.parametrize(
    "make", [lpsim.optim.FusedSGD, lpsim.optim.FusedAdam], ids=lambda c: c.__name__
)
def test_a_rule_set_on_a_fused_optimizers_group_applies_at_the_next_step(make):
    # The formats were made (format, rule) pairs when the group was made, so a rule set on the
    # group later was never used: the step went on rounding stochastically, silently.
    torch.manual_seed(0)
    w0 = torch.randn(256).to(torch.float8_e5m2).float()
    w = torch.nn.Parameter(w0.clone())
    kwargs = {"weight_decay": 0.0} if make is lpsim.optim.FusedAdam else {}
    opt = make([w], lr=0.5, weight_format=Float(5, 2), rounding="stochastic", **kwargs)
    opt.param_groups[0]["rounding"] = "nearest"
    w.grad = torch.randn(256).to(torch.float8_e5m2).float()
    reference = make([torch.nn.Parameter(w0.clone())], lr=0.5, **kwargs)  # no formats
    reference.param_groups[0]["params"][0].grad = w.grad.clone()
    reference.step()
    unrounded = reference.param_groups[0]["params"][0].detach()
    opt.step()
    # torch's float8_e5m2 cast rounds to nearest, ties to even
    assert torch.equal(w.detach(), unrounded.to(torch.float8_e5m2).float())


@pytest.mark.parametrize("write", ["to_csv", "to_json"])
def test_recorder_writers_refuse_a_file_descriptor_as_path(write, tmp_path):
    # open() takes an int as a file descriptor: the writer wrote its records into whatever file
    # the descriptor was open on, and closed it.
    import os

    recorder = lpsim.diagnostics.Recorder(torch.nn.Linear(2, 2))
    target = tmp_path / "other.txt"
    with open(target, "w") as other:
        other.write("kept\n")
        other.flush()
        with pytest.raises(TypeError, match=r"^path must be a str or os.PathLike, got int"):
            getattr(recorder, write)(other.fileno())
        os.fstat(other.fileno())  # still open
    assert target.read_text() == "kept\n"


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        # accepted silently where no bare format used the rule
        (
            lambda: lpsim.optim.ParameterQuantization(rounding="nearst"),
            ValueError,
            r"^rounding must be one of .*got 'nearst'",
        ),
        (
            lambda: lpsim.optim.OptimLP(
                torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), rounding="nearst"
            ),
            ValueError,
            r"^rounding must be one of .*got 'nearst'",
        ),
        # TypeError: 'int' object is not iterable
        (
            lambda: lpsim.optim.OptimLP(
                torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                weight=Float(5, 2),
                parameters=5,
            ),
            TypeError,
            r"^parameters must be None, an iterable of tensors or a mapping .*got int",
        ),
    ],
)
def test_optimlp_checks_its_rule_and_parameters_by_name(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_optimlp_reads_a_groups_quantization_set_after_the_group_was_made():
    # The settings were worked out once, when the groups were made: a "quantization" set on a
    # group later was never used (the weights stayed in float32), and a malformed one passed.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = lpsim.optim.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.param_groups[0]["quantization"] = lpsim.optim.ParameterQuantization(
        weight=Float(2, 1), rounding="nearest"
    )
    model(torch.randn(3, 4)).sum().backward()
    unrounded = [p.detach() - 0.1 * p.grad for p in model.parameters()]
    opt.step()
    for p, want in zip(model.parameters(), unrounded):
        # Float(2, 1): the values 0, +-0.5 (subnormal), +-1, +-1.5, +-2, +-3, Inf; nearest-even
        assert torch.equal(p.detach(), lpsim.quantize(want, Float(2, 1), "nearest"))
        assert set(p.detach().abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0}
    opt.param_groups[0]["quantization"] = "x"
    with pytest.raises(TypeError, match=r"^a parameter group's 'quantization' must be"):
        opt.step()


def test_recipe_apply_refuses_a_non_optimizer_before_injecting_the_model():
    # AttributeError: 'int' object has no attribute 'param_groups', raised after inject: the
    # model was left with the recipe's quantisers.
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer, got int"):
        lpsim.recipes.IBM8.apply(model, 5)
    assert lpsim.nn.injected(model) == []
    for call in (lambda: lpsim.recipes.edge_layers(5), lambda: lpsim.recipes.IBM8.layers(5)):
        with pytest.raises(TypeError, match=r"^model must be an nn.Module, got int"):
            call()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
@pytest.mark.parametrize("module", [False, True])
def test_an_error_only_quantizer_refuses_a_tensor_whose_gradient_it_cannot_round(module, dtype):
    # Without a forward format the tensor passed unchecked: an integer one silently (its
    # backward format never rounded anything), a complex one until the backward pass, which
    # raised there about a tensor "x" the caller never passed.
    make = lpsim.nn.Quantizer if module else lpsim.nn.quantizer
    round_errors = make(None, (Float(5, 2), "nearest"))
    x = torch.ones(3, dtype=dtype, requires_grad=dtype.is_complex)
    with pytest.raises(TypeError, match=r"^x must be a float32, float64, bfloat16 or float16"):
        round_errors(x)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.ones(3, dtype=dtype, requires_grad=True)
        round_errors(x).backward(torch.full((3,), 0.3, dtype=dtype))
        # 0.3 lies between 0.25 and 0.3125 of Float(5, 2), above their midpoint 0.28125
        assert torch.equal(x.grad, torch.full((3,), 0.3125, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_a_quantizer_takes_only_float_tensors_where_it_has_a_format(dtype):
    # quantizer()'s docstring: with a forward or a backward format only the four float
    # containers are taken (TypeError naming x); with neither, any tensor passes through.
    x = torch.ones(3, dtype=dtype)
    for spec in ({"forward": Float(5, 2)}, {"backward": Float(5, 2)}):
        for make in (lpsim.nn.quantizer, lpsim.nn.Quantizer):
            with pytest.raises(TypeError, match="x must be a float32"):
                make(**spec)(x)
    for make in (lpsim.nn.quantizer, lpsim.nn.Quantizer):
        assert make()(x) is x or torch.equal(make()(x), x)


def _stepped(make):
    """make([w]) for a float32 weight with a gradient, stepped once."""
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    make([w]).step()


HUGE = 2**1100  # an int that no float64 holds: float(HUGE) raises OverflowError


@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda: _stepped(lambda ps: lpsim.optim.SGD(ps, lr=HUGE)), "lr"),
        (lambda: _stepped(lambda ps: lpsim.optim.SGD(ps, weight_decay=HUGE)), "weight_decay"),
        (lambda: _stepped(lambda ps: lpsim.optim.AdamW(ps, eps=HUGE)), "eps"),
        (lambda: _stepped(lambda ps: lpsim.optim.FusedSGD(ps, momentum=HUGE)), "momentum"),
        (lambda: _stepped(lambda ps: lpsim.optim.FusedAdam(ps, eps=HUGE)), "eps"),
        (lambda: lpsim.optim.FusedSGD([torch.ones(2)], grad_scaling=HUGE), "grad_scaling"),
        (
            lambda: lpsim.optim.OptimLP(torch.optim.SGD([torch.ones(2)]), grad_scaling=HUGE),
            "grad_scaling",
        ),
        (lambda: lpsim.recipes.Recipe("huge", loss_scale=HUGE), r"Recipe\.loss_scale"),
    ],
)
def test_an_int_option_beyond_float64_is_refused_by_name(call, pattern):
    # These raised OverflowError ("int too large to convert to float") or, from the fused step's
    # op, "Expected a value of type 'List[float]'", naming no option.
    with pytest.raises(ValueError, match=rf"^{pattern} must be within the float64 range"):
        call()


@pytest.mark.parametrize("lookup", [lpsim.preset, lpsim.scaled.preset], ids=["format", "scaled"])
@pytest.mark.parametrize("name", [["e4m3fn"], {"nvfp4": 1}, None, 8])
def test_a_preset_name_that_is_not_a_str_is_refused_by_name(lookup, name):
    # A list or dict raised "unhashable type: 'list'" from the lookup.
    with pytest.raises(TypeError, match=rf"^name must be a str, got {type(name).__name__}$"):
        lookup(name)


@pytest.mark.parametrize("categories", [3, 2.5, True, Float(5, 2)])
def test_recorder_categories_that_are_not_iterable_are_refused_by_name(categories):
    # These raised "'int' object is not iterable" (and so on), naming no parameter.
    with pytest.raises(TypeError, match=r"^categories must be a str, an iterable of str or None"):
        lpsim.diagnostics.Recorder(torch.nn.Linear(2, 2), categories=categories)

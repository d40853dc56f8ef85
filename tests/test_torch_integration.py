"""The ops are well-formed torch custom ops: opcheck passes (schemas, fake kernels, autograd
registration), torch.compile(fullgraph=True) traces quantize and matches eager bit for bit."""

import pytest
import torch
from support import assert_same_bits

import lpsim
from lpsim import BlockFloat, Fixed, Float


def _grid_args(fmt, rule=0):
    return tuple(fmt.grid()) + (rule, 32, torch.tensor(5), 0)


@pytest.mark.parametrize("rule", [0, 8])
def test_opcheck_quantize_grid(rule):
    x = torch.randn(5, 7, requires_grad=True)
    torch.library.opcheck(torch.ops.lpsim.quantize_grid, (x,) + _grid_args(Float(5, 2), rule))
    y = torch.randn(5, 7)
    torch.library.opcheck(torch.ops.lpsim.quantize_grid_, (y,) + _grid_args(Fixed(8, 3), rule))
    torch.library.opcheck(
        torch.ops.lpsim.quantize_grid_out,
        (x.detach(),) + _grid_args(Float(4, 3), rule),
        {"out": torch.empty(5, 7)},
    )


@pytest.mark.parametrize("dim,block_size", [(None, None), (1, None), (None, 4)])
def test_opcheck_quantize_block(dim, block_size):
    x = torch.randn(6, 9, requires_grad=True)
    args = (6, dim, block_size, 8, 32, torch.tensor(3), 0)
    torch.library.opcheck(torch.ops.lpsim.quantize_block, (x,) + args)
    torch.library.opcheck(torch.ops.lpsim.quantize_block_, (torch.randn(6, 9),) + args)
    torch.library.opcheck(
        torch.ops.lpsim.quantize_block_out, (torch.randn(6, 9),) + args, {"out": torch.empty(6, 9)}
    )


@pytest.mark.parametrize("rule,seed", [(0, None), (8, torch.tensor(5))])
def test_opcheck_mac_matmul_and_the_rounded_sums(rule, seed):
    """The ops of lpsim.mac and lpsim.accumulate have fake kernels, which torch.export and
    torch.compile trace them with (without, export raised UnsupportedOperatorException)."""
    grid = tuple(Float(5, 10).grid())
    random = (rule, 32, seed, 0)
    a, b = torch.randn(3, 6), torch.randn(4, 6)
    mac = (a, b, 0, 1, False, False, 0, 0, None, 0, 0) + grid + grid + grid + random
    torch.library.opcheck(torch.ops.lpsim.mac_matmul, mac)
    torch.library.opcheck(torch.ops.lpsim.dot_rounded, (a, b, False) + grid + grid + random)
    for cumulative in (False, True):
        sums = (a, 3, 2, 3, cumulative) + grid + random
        torch.library.opcheck(torch.ops.lpsim.sum_rounded, sums)


@pytest.mark.parametrize("rule", ["nearest", "stochastic"])
def test_an_exported_model_with_mac_products_gives_the_eager_bits(rule):
    """torch.export.export of an injected model whose products run under a non-native MAC (a
    convolution and a linear layer) gives a program that computes the eager bits, call by call
    under the same torch.manual_seed: a stochastic MAC's seed is drawn by the program at each
    call. Export raised UnsupportedOperatorException (the op had no fake kernel), and for a
    stochastic MAC GuardOnDataDependentSymNode (its seed was made a Python int)."""
    from lpsim.nn import LayerQuantization, inject

    mac = lpsim.MAC(accumulator=Float(5, 4), rounding=rule)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(48, 4)
    )
    layers = (torch.nn.Conv2d, torch.nn.Linear)
    inject(model, {layers: LayerQuantization(mac=mac, output=Float(5, 2), rounding=rule)})
    x = torch.randn(2, 2, 6, 6)
    exported = torch.export.export(model, (x,)).module()
    for seed in (3, 4):
        torch.manual_seed(seed)
        want = model(x)
        torch.manual_seed(seed)
        assert_same_bits(exported(x), want, f"seed {seed}")


def test_an_exported_tensor_core_checks_its_operands_at_each_call():
    """A tensor core with an ``operands`` format refuses operands that are not its values; in an
    exported program the check is made at each call (it failed to export: a Python branch on the
    values), and the program's products are the eager ones."""

    class Product(torch.nn.Module):
        def forward(self, a, b):
            return lpsim.mac.matmul(a, b, lpsim.mac.preset("H100/tf32"))

    a = torch.randn(3, 40).bfloat16().float()  # tf32 values
    b = torch.randn(40, 2).bfloat16().float()
    exported = torch.export.export(Product(), (a, b)).module()
    assert_same_bits(exported(a, b), Product()(a, b))
    wide = a.clone()
    wide[1, 7] = 1 + 2.0**-20  # not a tf32 value
    with pytest.raises(ValueError, match="a holds values that are not"):
        Product()(wide, b)
    with pytest.raises(RuntimeError, match="a holds values that are not"):
        exported(wide, b)


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


def test_a_quantizer_module_keeps_nn_modules_backward_hooks_and_compiles_to_the_eager_bits():
    """A Quantizer held its backward_hooks tuple where nn.Module keeps its dict of full backward
    hooks: register_full_backward_hook on it raised, and dynamo failed on every compiled model
    holding one. Now the module's hooks are its own, and a compiled model gives the
    eager outputs, torch's float8_e5m2 casts, and the eager gradients: the Quantizer's backward
    hook (times 4), then torch's float8_e4m3fn cast of the gradient."""
    from lpsim.nn import Quantizer

    e4m3 = lpsim.preset("e4m3fn_saturating")  # torch's float8_e4m3fn cast

    def make():
        torch.manual_seed(0)
        q = Quantizer(Float(5, 2), e4m3, "nearest", "nearest", backward_hooks=[lambda g: g * 4])
        return torch.nn.Sequential(torch.nn.Linear(6, 5), q)

    eager, model = make(), make()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 8
    g = torch.randn(4, 5, generator=torch.Generator().manual_seed(2)) * 100
    y = eager(x)
    assert_same_bits(y, eager[0](x).detach().to(torch.float8_e5m2).float())
    got = compiled(x)
    assert_same_bits(got, y)
    y.backward(g)
    got.backward(g)
    want_bias_grad = (g * 4).to(torch.float8_e4m3fn).float().sum(0)
    assert torch.equal(eager[0].bias.grad, want_bias_grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))

    seen = []
    eager[1].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out))
    eager(x).backward(g)
    assert len(seen) == 1 and torch.equal(seen[0][0], g)


def test_compiled_unseeded_stochastic_rounding_traces():
    torch._dynamo.reset()

    def f(x):
        return lpsim.quantize(x, Float(5, 2), "stochastic")

    y = torch.compile(f, fullgraph=True)(torch.full((1000,), 1.1))
    assert set(y.unique().tolist()) <= {1.0, 1.25}


# In-place and out= ops under autograd: they bump the version counter of the tensor they write (in
# no_grad too) and refuse a leaf that requires grad, as torch's own in-place ops do, whether they
# are called through lpsim's functions, through torch.ops.lpsim or from compiled code.

_SEED = torch.tensor(5)
_GRID = tuple(Float(3, 1).grid()) + (0, 32, _SEED, 0)  # after x in quantize_grid's schema
_UPDATE = tuple(Float(3, 1).grid()) + (8, 32, _SEED, 0, 0)  # after sr_add's operands

# Each writes into its argument t, a float32 tensor of shape (3,).
IN_PLACE = {
    "quantize_ Float": lambda t: lpsim.quantize_(t, Float(3, 1), "nearest"),
    "quantize_ BlockFloat": lambda t: lpsim.quantize_(t, BlockFloat(4), "stochastic", seed=1),
    "sr_add_": lambda t: lpsim.sr_add_(t, 0.3, Float(3, 1), seed=2),
    "sr_addcmul_": lambda t: lpsim.sr_addcmul_(t, torch.ones(3), torch.ones(3), 0.3, seed=3),
    "sr_addcdiv_": lambda t: lpsim.sr_addcdiv_(t, torch.ones(3), torch.ones(3), 0.3, seed=4),
    "ops.quantize_grid_": lambda t: torch.ops.lpsim.quantize_grid_(t, *_GRID),
    "ops.quantize_block_": lambda t: torch.ops.lpsim.quantize_block_(
        t, 4, None, None, 0, 32, _SEED, 0
    ),
    "ops.sr_add_": lambda t: torch.ops.lpsim.sr_add_(t, torch.full((3,), 0.3), *_UPDATE),
}
OUT = {
    "quantize out= Float": lambda t: lpsim.quantize(torch.full((3,), 1.1), Float(3, 1), out=t),
    "quantize out= BlockFloat": lambda t: lpsim.quantize(
        torch.full((3,), 1.1), BlockFloat(4), out=t
    ),
    "ops.quantize_grid_out": lambda t: torch.ops.lpsim.quantize_grid_out(
        torch.full((3,), 1.1), *_GRID, out=t
    ),
}
WRITING = {**IN_PLACE, **OUT}


def _values():
    return torch.tensor([1.1, 2.3, 3.7])


def test_opcheck_in_place_ops_with_autograd_inputs():
    x = torch.randn(4, 5, requires_grad=True) * 1  # a non-leaf: written in place, keeps history
    torch.library.opcheck(torch.ops.lpsim.quantize_grid_, (x,) + _GRID)
    torch.library.opcheck(torch.ops.lpsim.sr_add_, (x, torch.randn(4, 5)) + _UPDATE)
    torch.library.opcheck(
        torch.ops.lpsim.sr_addc_, (x, torch.randn(4, 5), torch.rand(4, 5) + 1, 0.5, True) + _UPDATE
    )


def test_every_writing_op_has_autograd_and_version_kernels():
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("lpsim::")]
    writing = [n for n in names if torch._C._get_schema(n, "").is_mutable]
    assert len(writing) >= 6, writing
    for name in writing:
        for key in ("Autograd", "ADInplaceOrView"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("write", WRITING.values(), ids=WRITING.keys())
def test_writing_bumps_the_version_counter(write, grad_mode):
    t = _values()
    before = t._version
    with torch.set_grad_enabled(grad_mode):
        write(t)
    assert t._version > before


@pytest.mark.parametrize("write", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_backward_refuses_values_overwritten_in_place(write):
    a = _values().requires_grad_()
    b = a * 1
    y = (b * b).sum()  # saves b
    write(b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("write", WRITING.values(), ids=WRITING.keys())
def test_backward_refuses_values_overwritten_under_no_grad(write):
    a = _values().requires_grad_()
    b = a * 1
    y = (b * b).sum()
    with torch.no_grad():
        write(b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("write", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_in_place_ops_refuse_a_leaf_that_requires_grad(write):
    a = _values().requires_grad_()
    with pytest.raises(
        RuntimeError,
        match="a leaf Variable that requires grad is being used in an in-place operation",
    ):
        write(a)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        write(a.view(3))
    assert torch.equal(a.detach(), _values())
    with torch.no_grad():  # as an optimizer does
        write(a)
    assert not torch.equal(a.detach(), _values())


@pytest.mark.parametrize("write", OUT.values(), ids=OUT.keys())
def test_out_ops_refuse_arguments_that_require_grad(write):
    message = r"functions with out=\.\.\. arguments don't support automatic differentiation"
    with pytest.raises(RuntimeError, match=message):
        write(_values().requires_grad_())
    with pytest.raises(RuntimeError, match=message):
        lpsim.quantize(_values().requires_grad_(), Float(3, 1), out=torch.empty(3))
    with pytest.raises(RuntimeError, match=message):
        write(_values().requires_grad_() * 1)  # a non-leaf's history would no longer hold
    with torch.no_grad():
        write(_values().requires_grad_())


def test_in_place_rounding_of_a_non_leaf_is_straight_through():
    a = _values().requires_grad_()
    b = a * 3
    lpsim.quantize_(b, Float(3, 1), "nearest")
    assert torch.equal(b.detach(), torch.tensor([3.0, 6.0, 12.0]))
    (b * 2).sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 6.0))


def test_sr_add_in_place_does_not_drop_the_gradient_of_b():
    a, b = _values(), torch.full((3,), 0.3, requires_grad=True)
    lpsim.sr_add_(a, b, seed=0)
    with pytest.raises(RuntimeError, match="derivative for lpsim::sr_add_ is not implemented"):
        a.sum().backward()
    assert b.grad is None


def test_compiled_in_place_ops_refuse_a_leaf_and_bump_the_version():
    torch._dynamo.reset()

    def f(t):
        lpsim.quantize_(t, Float(3, 1), "nearest")
        lpsim.sr_add_(t, 0.25, Float(3, 1), "nearest")
        return t * 2

    compiled = torch.compile(f, fullgraph=True)
    t, want = _values(), f(_values())
    assert_same_bits(compiled(t), want)
    assert t._version > 0
    a = _values().requires_grad_()
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        compiled(a)
    with torch.no_grad():
        assert_same_bits(compiled(a), want)
    assert a._version > 0


def test_every_op_with_a_floating_point_argument_has_an_autograd_kernel():
    """No lpsim op falls to torch's fallback for custom ops without an autograd kernel, which
    gives the inputs no gradient and only warns."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("lpsim::")]
    tensor_ops = [
        n
        for n in names
        if any("Tensor" in str(a.type) for a in torch._C._get_schema(n, "").arguments)
    ]
    # ops whose tensor arguments are integer or bit tensors: nothing to differentiate
    no_floating_point_arguments = {
        "lpsim::random_words",
        "lpsim::value_words",
        "lpsim::_check_disjoint",
        "lpsim::dyadic_add",
        "lpsim::dyadic_div",
        "lpsim::dyadic_mul",
        "lpsim::dyadic_matmul",
        "lpsim::dyadic_requantize",
        "lpsim::dyadic_from_float",
    }
    missing = [
        n
        for n in tensor_ops
        if n not in no_floating_point_arguments
        and not torch._C._dispatch_has_kernel_for_dispatch_key(n, "Autograd")
    ]
    assert missing == []


def _undifferentiable_results():
    x = torch.tensor([1.5, 2.25, 3.0], requires_grad=True)
    m = torch.tensor([[1.5, 2.25], [0.5, 3.0]], requires_grad=True)
    acc = Float(5, 2)
    return {
        "accumulate.sum": lambda: lpsim.accumulate.sum(x, acc=acc),
        "accumulate.cumsum": lambda: lpsim.accumulate.cumsum(x, 0, acc=acc),
        "accumulate.matvec": lambda: lpsim.accumulate.matvec(m, x[:2], acc=acc),
        "accumulate.matmul": lambda: lpsim.accumulate.matmul(m, m, acc=acc),
        "mac.matmul": lambda: lpsim.mac.matmul(m, m, lpsim.MAC(accumulator=acc)),
        "sr_addcmul": lambda: lpsim.sr_addcmul(x, x, x, fmt=acc, seed=0),
        "sr_addcdiv": lambda: lpsim.sr_addcdiv(x, x, x, fmt=acc, seed=0),
    }


@pytest.mark.parametrize("name", _undifferentiable_results().keys())
def test_backward_through_an_op_without_derivative_raises(name):
    """Even summed with a differentiable path, whose gradient torch's fallback kept while it
    silently dropped this one's."""
    y = _undifferentiable_results()[name]()
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="no derivative"):
        (y.sum() + 0.0).backward()


@pytest.mark.parametrize("name", _undifferentiable_results().keys())
def test_ops_without_derivative_give_results_without_history_under_no_grad(name):
    with torch.no_grad():
        y = _undifferentiable_results()[name]()
    assert not y.requires_grad and y.grad_fn is None


def test_to_container_is_straight_through_in_its_input_dtype():
    x = torch.tensor([1.0, 2.0**-1074, 3.5], dtype=torch.float64, requires_grad=True)
    y = torch.ops.lpsim.to_container(x, torch.float32)
    assert y.dtype == torch.float32
    y.backward(torch.tensor([2.0, 3.0, 4.0]))
    assert x.grad.dtype == torch.float64 and x.grad.tolist() == [2.0, 3.0, 4.0]


# torch.func transforms through a Quantizer: its gradient is the one backward() computes.


def _quantizer_loss(clamp_grad_zero):
    q = lpsim.nn.Quantizer(
        forward=Fixed(6, 3),
        backward=Float(5, 2),
        forward_rounding="nearest",
        backward_rounding="nearest",
        clamp_grad_zero=clamp_grad_zero,
    )
    weights = torch.arange(6.0) * 1.1 + 0.1
    return lambda x: (q(x) * weights).sum()


def _backward_gradient(loss, x):
    x = x.clone().requires_grad_()
    loss(x).backward()
    return x.grad


@pytest.mark.parametrize("clamp_grad_zero", [False, True])
def test_func_grad_and_jacrev_through_a_quantizer_equal_backward(clamp_grad_zero):
    loss = _quantizer_loss(clamp_grad_zero)
    x = torch.tensor([0.3, -1.7, 2.2, 9.0, -3.1, 0.06])  # 9.0 clips in Fixed(6, 3)
    want = _backward_gradient(loss, x)
    assert_same_bits(torch.func.grad(loss)(x), want)
    assert_same_bits(torch.func.jacrev(loss)(x), want)


@pytest.mark.parametrize("clamp_grad_zero", [False, True])
def test_per_sample_gradients_through_a_quantizer_equal_the_per_sample_loop(clamp_grad_zero):
    loss = _quantizer_loss(clamp_grad_zero)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 4
    want = torch.stack([_backward_gradient(loss, sample) for sample in x])
    assert_same_bits(torch.func.vmap(torch.func.grad(loss))(x), want)


# Forward-mode AD: quantize passes a tangent unchanged, as its reverse-mode gradient.

_FORWARD_FORMATS = {
    "Float": Float(4, 3),
    "Fixed": Fixed(6, 3),
    "BlockFloat": BlockFloat(6, 0),
    "Scaled": lpsim.scaled.preset("mxfp8_e4m3"),
}


@pytest.mark.parametrize("fmt", _FORWARD_FORMATS.values(), ids=_FORWARD_FORMATS.keys())
def test_jvp_and_jacfwd_of_quantize_are_straight_through(fmt):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    tangent = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))

    def f(x):
        return lpsim.quantize(x, fmt, "stochastic", seed=4) * 3.0

    value, derivative = torch.func.jvp(f, (x,), (tangent,))
    assert_same_bits(value, f(x))
    assert_same_bits(derivative, tangent * 3.0)
    jacobian = torch.func.jacfwd(f)(x)
    assert_same_bits(jacobian, torch.eye(12).reshape(3, 4, 3, 4) * 3.0)


@pytest.mark.parametrize("fmt", _FORWARD_FORMATS.values(), ids=_FORWARD_FORMATS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_hessian_through_quantize_is_the_straight_through_one(fmt, dtype):
    # f(x) = sum(3 q(x)^2): with dq/dx = 1 the gradient is 6 q(x) and the Hessian 6 I. The second
    # differentiation is forward mode over the first's backward (torch.func.hessian is
    # jacfwd(jacrev)), so it needs quantize's tangent: without it the Hessian is silently zero.
    x = torch.randn(2, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))

    def f(x):
        return (3.0 * lpsim.quantize(x, fmt, "nearest") ** 2).sum()

    assert_same_bits(torch.func.hessian(f)(x), 6.0 * torch.eye(10, dtype=dtype).reshape(2, 5, 2, 5))


def test_tangent_of_sr_add_is_the_sum_of_the_operands_tangents():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=generator), torch.randn(4, generator=generator)
    ta, tb = torch.randn(3, 4, generator=generator), torch.randn(4, generator=generator)

    def f(a, b):
        return lpsim.sr_add(a, b, Float(5, 2), seed=3)

    value, tangent = torch.func.jvp(f, (a, b), (ta, tb))
    assert_same_bits(value, f(a, b))
    assert_same_bits(tangent, ta + tb)
    # Only the broadcast operand b has a tangent: the result's is b's, broadcast to a's shape.
    _, tangent = torch.func.jvp(lambda b: f(a, b), (b,), (tb,))
    assert_same_bits(tangent, tb.expand(3, 4))


def test_forward_mode_through_an_in_place_rounding_keeps_the_tangent():
    x = torch.randn(6, generator=torch.Generator().manual_seed(0))
    tangent = torch.randn(6, generator=torch.Generator().manual_seed(1))
    value, derivative = torch.func.jvp(
        lambda x: lpsim.quantize_(x * 2.0, Float(4, 3)), (x,), (tangent,)
    )
    assert_same_bits(value, lpsim.quantize(x * 2.0, Float(4, 3)))
    assert_same_bits(derivative, tangent * 2.0)


_NO_FORWARD_DERIVATIVE = {
    "accumulate.sum": lambda x: lpsim.accumulate.sum(x, acc=Float(5, 2)),
    "mac.matmul": lambda x: lpsim.mac.matmul(x, x.T.contiguous(), lpsim.MAC(Float(5, 2))),
    "sr_addcmul": lambda x: lpsim.sr_addcmul(x, x, x, fmt=Float(5, 2), seed=1),
    "quantize out=": lambda x: lpsim.quantize(x, Float(4, 3), out=torch.empty_like(x)),
    "sr_add_ b": lambda x: lpsim.sr_add_(torch.zeros(3, 4), x, Float(5, 2), seed=1),
}


@pytest.mark.parametrize("f", _NO_FORWARD_DERIVATIVE.values(), ids=_NO_FORWARD_DERIVATIVE.keys())
def test_forward_mode_through_an_op_without_that_derivative_raises(f):
    # Torch's rule for its own ops: NotImplementedError, not a result without a tangent (a
    # silently zero derivative).
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(f, (x,), (torch.ones(3, 4),))


@pytest.mark.parametrize("clamp_grad_zero", [False, True])
def test_jvp_through_a_quantizer_is_its_straight_through_derivative(clamp_grad_zero):
    loss = _quantizer_loss(clamp_grad_zero)
    x = torch.tensor([0.3, -1.7, 2.2, 9.0, -3.1, 0.06])  # 9.0 clips in Fixed(6, 3)
    tangent = torch.tensor([1.0, 2.0, -1.0, 4.0, 0.5, -3.0])
    value, derivative = torch.func.jvp(loss, (x,), (tangent,))
    assert_same_bits(value, loss(x))
    # loss(x) = sum(q(x) * weights): its tangent is sum(t * weights), t zero where x clipped if
    # clamp_grad_zero; unlike the gradient, the tangent is not rounded by the backward format.
    passed = tangent.masked_fill(x.abs() > 4, 0.0) if clamp_grad_zero else tangent
    assert_same_bits(derivative, (passed * (torch.arange(6.0) * 1.1 + 0.1)).sum())


def _straight_through(x, fmt):
    """x rounded into fmt with the straight-through gradient, written with torch alone."""
    return x + (lpsim.quantize(x.detach(), fmt, "nearest") - x).detach()


def test_second_derivatives_through_a_backward_format_round_in_reverse_mode_only():
    fmt = Float(4, 3)
    quantise = lpsim.nn.quantizer(fmt, fmt, "nearest", "nearest")
    x = torch.tensor([-1.3, 1.9, 0.41, -0.77, 0.9], dtype=torch.float64)

    def loss(t):
        return (quantise(t) ** 3).sum()

    # The oracle: the first derivative is 3 q(x)^2 rounded by the backward format, whose
    # rounding is straight-through when differentiated; the second derivative 6 q(x) then flows
    # back through the quantiser, which rounds it in reverse mode and passes it in forward mode.
    q = _straight_through(x, fmt)
    second = torch.diag(6 * q.detach())
    # (+ 0.0: the off-diagonal zeros come as -0.0 from some products)
    assert_same_bits(torch.func.hessian(loss)(x) + 0.0, second)
    reverse = lpsim.quantize(6 * q.detach(), fmt, "nearest")
    assert not torch.equal(reverse, 6 * q.detach())  # the two modes differ here
    assert_same_bits(torch.func.jacrev(torch.func.jacrev(loss))(x) + 0.0, torch.diag(reverse))
    leaf = x.clone().requires_grad_()
    (first,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    assert_same_bits(first, lpsim.quantize(3 * q.detach() ** 2, fmt, "nearest"))
    (again,) = torch.autograd.grad(first.sum(), leaf)
    assert_same_bits(again, reverse)


def test_second_derivatives_of_a_compiled_quantize_are_refused_or_unconnected_as_documented():
    """docs/training.md: torch.compile does not differentiate its backward graphs. Eager mode's
    second derivative of sum(q(x)**3) is 6 q(x) (q straight-through); the compiled function's
    gradient reaches no input (it saved q(x), not x): grad raises, with allow_unused None, and
    backward() raises torch's double backward error."""
    fmt = Float(5, 2)

    def f(t):
        return (lpsim.quantize(t, fmt, "nearest") ** 3).sum()

    x = torch.tensor([0.3, 1.7, -2.2], requires_grad=True)
    q = lpsim.quantize(x.detach(), fmt, "nearest")
    (first,) = torch.autograd.grad(f(x), x, create_graph=True)
    assert torch.equal(torch.autograd.grad(first.sum(), x)[0], 6 * q)
    compiled = torch.compile(f, backend="aot_eager")
    (first,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    assert torch.equal(first, 3 * q**2)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(first.sum(), x, retain_graph=True)
    assert torch.autograd.grad(first.sum(), x, retain_graph=True, allow_unused=True) == (None,)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        first.sum().backward()


def test_a_retained_graph_rounds_its_errors_anew_at_each_backward():
    fmt = Float(5, 2)
    x = torch.linspace(-3, 3, 64, requires_grad=True)
    error = torch.linspace(0.1, 2.3, 64)
    y = lpsim.nn.quantizer(fmt, fmt)(x)  # stochastic forward and backward
    forward = y.detach().clone()
    torch.manual_seed(5)
    (first,) = torch.autograd.grad(y, x, error, retain_graph=True)
    (second,) = torch.autograd.grad(y, x, error, retain_graph=True)
    assert not torch.equal(first, second)
    torch.manual_seed(5)
    (repeated,) = torch.autograd.grad(y, x, error)
    assert_same_bits(repeated, first)  # the words come from torch's generator
    assert_same_bits(y, forward)
    torch.manual_seed(5)
    assert_same_bits(first, lpsim.quantize(error, fmt, "stochastic"))


def test_stochastic_rounding_under_vmap_follows_its_randomness_flag():
    # A seed that lpsim draws (seed=None) is drawn as torch's random ops are under vmap: an error
    # in vmap's default mode, one seed for every sample with "same", a seed each with
    # "different", both from torch's generator as torch.randint draws them there.
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))

    def f(row):
        return lpsim.quantize(row, Float(3, 2), "stochastic")

    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(f)(x)
    torch.manual_seed(5)
    seed = int(torch.randint(2**63 - 1, ()))
    torch.manual_seed(5)
    same = torch.vmap(f, randomness="same")(x)
    assert_same_bits(
        same, torch.stack([lpsim.quantize(r, Float(3, 2), "stochastic", seed=seed) for r in x])
    )
    torch.manual_seed(5)
    seeds = torch.randint(2**63 - 1, (4,)).tolist()
    torch.manual_seed(5)
    different = torch.vmap(f, randomness="different")(x)
    want = torch.stack(
        [
            lpsim.quantize(r, Float(3, 2), "stochastic", seed=s)
            for r, s in zip(x, seeds, strict=True)
        ]
    )
    assert_same_bits(different, want)
    assert len(set(seeds)) == 4


@pytest.mark.parametrize(
    "write",
    [
        lambda row: lpsim.quantize_(row, Float(5, 2)),
        lambda row: lpsim.quantize_many_([row], Float(5, 2)),
        lambda row: lpsim.quantize_(row, BlockFloat(4)),
        lambda row: lpsim.sr_add_(row, 1.0, Float(5, 2), "nearest"),
        lambda row: lpsim.sr_addcmul_(row, row, row, 0.5, Float(5, 2), "nearest"),
        lambda row: lpsim.quantize(row * 2, Float(5, 2), out=row),
    ],
    ids=["quantize_", "quantize_many_", "quantize_ BlockFloat", "sr_add_", "sr_addcmul_", "out="],
)
def test_ops_that_write_into_an_argument_are_refused_under_vmap(write):
    # As docs/training.md states: vmap's fallback runs the out-of-place ops once per sample but
    # takes no op that writes into an argument; the rows are left as they were.
    x = torch.randn(3, 8)
    before = x.clone()
    with pytest.raises(RuntimeError, match="Batching rule not implemented"):
        torch.vmap(write)(x)
    assert torch.equal(x, before)

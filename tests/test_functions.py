"""lpsim.nn.quantize_functions: the function calls a model makes (matrix products, softmax,
attention) quantised as the config selects.

The proofs: with empty settings every op is torch's (bit for bit where the computation is the same
call, to float64 rounding where attention is computed step by step); with formats and MACs each
op equals the same quantisers and lpsim.nn.functional products applied by hand, forward and
backward, bit for bit; inside F.scaled_dot_product_attention, nn.MultiheadAttention and
nn.TransformerEncoderLayer the scores and context products are on the format's grid (seen by an
outer TorchFunctionMode that records the calls the decomposition makes); selection by op and by
module, precedence of inject's MACs, eval rounding, seeds and errors."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import assert_same_bits
from torch import nn
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import lpsim
import lpsim.nn.functional as LF
from lpsim import MAC, Float
from lpsim.delayed_scaling import DelayedScaling
from lpsim.nn import LayerQuantization, inject, quantize_functions
from lpsim.scaled import preset

E4M3 = Float(4, 3)
E5M2 = Float(5, 2)
BF16 = Float(8, 7)
BF16_MAC = MAC(accumulator=BF16)
FP16_MAC = MAC(accumulator=Float(5, 10))


def nearest(**fields) -> LayerQuantization:
    return LayerQuantization(rounding="nearest", **fields)


class Recorder(torch.overrides.TorchFunctionMode):
    """Records (name, first argument, result) of the softmax, matmul and linear calls it sees."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.softmax, F.softmax, torch.matmul, F.linear):
            self.calls.append((func.__name__, args[0].detach().clone(), out.detach().clone()))
        return out

    def named(self, name):
        return [(x, y) for n, x, y in self.calls if n == name]


def on_grid(x: torch.Tensor, fmt) -> bool:
    finite = x[torch.isfinite(x)]
    return torch.equal(lpsim.quantize(finite, fmt), finite)


class Products(nn.Module):
    """Calls every op lpsim.nn.quantize_functions takes, in a submodule ``a`` and the model."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x) @ self.b.weight
        return torch.softmax(torch.matmul(y, x.transpose(-2, -1)), dim=-1)


class Attention(nn.Module):
    """Causal self-attention by F.scaled_dot_product_attention; head_dim 16, so the scale 1/4 is
    exact and the scores keep their grid after it."""

    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ---- With empty settings every op is torch's.


def test_empty_settings_leave_products_and_softmax_as_torch_bit_for_bit():
    torch.manual_seed(0)
    model, x = Products(), torch.randn(3, 5, 8)
    expected = model(x)
    config = {op: LayerQuantization() for op in ("matmul", "linear", "softmax")}
    with quantize_functions(model, config):
        got = model(x)
    assert_same_bits(got, expected)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"scale": 0.3},
        {"attn_mask": "bool"},
        {"attn_mask": "float"},
        {"enable_gqa": True},
    ],
    ids=lambda o: "-".join(f"{k}" for k in o) or "plain",
)
def test_stepwise_attention_is_torchs_to_float64_rounding_forward_and_backward(options):
    torch.manual_seed(1)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    kv_heads = 2 if options.get("enable_gqa") else 4
    k = torch.randn(2, kv_heads, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 7, 8, dtype=torch.float64, requires_grad=True)
    options = dict(options)
    if options.get("attn_mask") == "bool":
        options["attn_mask"] = torch.rand(5, 7) > 0.3
        options["attn_mask"][:, 0] = True
    elif options.get("attn_mask") == "float":
        options["attn_mask"] = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, **options)
    grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    with quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()}):
        got = F.scaled_dot_product_attention(q, k, v, **options)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, grads):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("lower_right", [False, True], ids=["upper-left", "lower-right"])
@pytest.mark.parametrize("target, source", [(3, 6), (6, 3), (4, 4)])
def test_a_causal_bias_mask_is_the_causal_mask_it_stands_for_as_in_torch(
    lower_right, target, source
):
    """torch.nn.attention.bias's causal_upper_left and causal_lower_right make a tensor subclass
    whose storage holds no mask (torch's attention dispatches on its variant): the stepwise
    attention added that storage to the scores as a float mask, silently. It is the causal mask
    torch applies, forward and backward."""
    torch.manual_seed(26)
    q = torch.randn(2, 2, target, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, source, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    with warnings.catch_warnings():  # torch warns of lower-right rows without keys
        warnings.simplefilter("ignore")
        mask = (causal_lower_right if lower_right else causal_upper_left)(target, source)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    with quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()}):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with pytest.raises(ValueError, match="must have the queries' and keys' sizes"):
            F.scaled_dot_product_attention(q[..., :2, :], k, v, attn_mask=mask)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, grads):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("key_heads, value_heads", [(4, 2), (2, 4), (2, 1)])
def test_grouped_query_attention_groups_keys_and_values_by_their_own_head_counts(
    key_heads, value_heads
):
    """torch repeats the key and the value each by its own head count: the stepwise attention
    grouped both by the key's, and failed on a broadcast where the value had other heads."""
    torch.manual_seed(28)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, key_heads, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, value_heads, 7, 3, dtype=torch.float64, requires_grad=True)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    with quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()}):
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, grads):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-11)


def test_grouped_query_attention_quantises_each_key_and_value_head_once():
    """With enable_gqa a key head serves 3 query heads: stochastic rounding rounds it once, as the
    one tensor it is, not each of 3 repeated copies its own way."""
    torch.manual_seed(18)
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    product = LayerQuantization(input=E4M3, weight=E4M3, output=E4M3, rounding="stochastic")
    config = {"attention.scores": product, "attention.context": product}
    torch.manual_seed(19)
    with quantize_functions(nn.Identity(), config):
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.manual_seed(19)  # the same draws, in the steps' order: operands, then the result
    rounded = lambda t: lpsim.quantize(t, E4M3, "stochastic")  # noqa: E731
    q, k_t = rounded(q), rounded(k.transpose(-2, -1)).repeat_interleave(3, dim=1)
    weights = torch.softmax(rounded(q @ k_t) * 0.25, dim=-1)
    weights, v = rounded(weights), rounded(v).repeat_interleave(3, dim=1)
    assert_same_bits(got, rounded(weights @ v))


def test_an_unselected_encoder_layer_in_eval_is_torchs_non_fused_path_bit_for_bit():
    """Any active TorchFunctionMode turns torch's fused eval fast path off: inside the context an
    encoder layer no entry selects gives the bits of torch's other path (seen under a mode that
    selects nothing of torch's), as the docs say."""

    class Inert(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(25)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), nn.Linear(16, 4))
    model.eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        with Inert():
            expected = model(x)
        with quantize_functions(model, {("linear", "1"): LayerQuantization()}):
            got = model(x)
    assert_same_bits(got, expected)


def test_an_unselected_encoder_with_padding_in_eval_gives_the_padded_positions_of_the_other_path():
    """nn.TransformerEncoder's fast path turns a padded batch into a nested tensor and returns
    zeros at the padded positions; inside the context it takes its other path, which computes
    them, as the docs say (bit for bit that path's, seen under a mode that selects nothing)."""

    class Inert(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(27)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    model = nn.Sequential(encoder, nn.Linear(16, 4))
    encoder.eval()
    x, padding = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on its fast path
        fast = encoder(x, src_key_padding_mask=padding)
        with Inert():
            expected = encoder(x, src_key_padding_mask=padding)
        with quantize_functions(model, {("linear", "1"): LayerQuantization()}):
            got = encoder(x, src_key_padding_mask=padding)
            model[1](got)
    assert_same_bits(got, expected)
    assert fast[0, 3:].eq(0).all() and not got[0, 3:].eq(0).any()


def test_multihead_attention_under_empty_settings_is_torchs_to_float64_rounding():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected, weights = mha(x, x, x, attn_mask=mask)
    with quantize_functions(mha, {"attention.context": LayerQuantization()}):
        got, got_weights = mha(x, x, x, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_weights, weights, rtol=1e-12, atol=1e-12)


# ---- Formats and MACs: the same quantisers and products applied by hand, bit for bit.


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: a @ b,
        lambda a, b: torch.matmul(a, b),
        lambda a, b: a.matmul(b),
        lambda a, b: torch.bmm(a, b),
        lambda a, b: a.bmm(b),
        lambda a, b: torch.mm(a[0], b[0]),
        lambda a, b: a[0].mm(b[0]),
        lambda a, b: torch.linalg.matmul(a, b),
        lambda a, b: b.__rmatmul__(a),
    ],
    ids=[
        "operator",
        "matmul",
        "method",
        "bmm",
        "bmm-method",
        "mm",
        "mm-method",
        "linalg-matmul",
        "rmatmul",
    ],
)
def test_matmul_quantises_operands_result_and_sums_under_the_mac(call):
    torch.manual_seed(3)
    a = torch.randn(2, 5, 64, requires_grad=True)
    b = torch.randn(2, 64, 3, requires_grad=True)
    settings = nearest(input=E4M3, weight=E5M2, output=BF16, error=E5M2, mac=FP16_MAC)
    with quantize_functions(nn.Identity(), {"matmul": settings}):
        got = call(a, b)
    grads = torch.autograd.grad(got.sum() * 3.1, (a, b))
    qa = lpsim.quantize(a.detach(), E4M3).requires_grad_()
    qb = lpsim.quantize(b.detach(), E5M2).requires_grad_()
    two_dimensional = got.dim() == 2  # mm: the first matrices
    product = LF.matmul(
        qa[0] if two_dimensional else qa,
        qb[0] if two_dimensional else qb,
        mac=FP16_MAC,
        grad_format=(E5M2, "nearest"),
    )
    expected_grads = torch.autograd.grad(product.sum() * 3.1, (qa, qb))
    assert_same_bits(got.detach(), lpsim.quantize(product.detach(), BF16))
    for g, e in zip(grads, expected_grads):
        assert_same_bits(g, e)


def test_linear_takes_bias_format_and_all_three_macs_bit_for_bit():
    torch.manual_seed(4)
    layer = nn.Linear(96, 4)
    x = torch.randn(7, 96, requires_grad=True)
    macs = dict(mac=BF16_MAC, input_grad_mac=FP16_MAC, weight_grad_mac=BF16_MAC)
    settings = nearest(input=E4M3, weight=E4M3, bias=E5M2, **macs)
    with quantize_functions(layer, {"linear": settings}):
        got = layer(x)
    got_grads = torch.autograd.grad(got.square().sum(), (x, layer.weight, layer.bias))
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = (p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias))
    expected = LF.linear(
        lpsim.quantize(x2, E4M3),
        lpsim.quantize(w2, E4M3),
        lpsim.quantize(b2, E5M2),
        **macs,
    )
    expected_grads = torch.autograd.grad(expected.square().sum(), (x2, w2, b2))
    assert_same_bits(got, expected)
    for g, e in zip(got_grads, expected_grads):
        assert_same_bits(g, e)


def test_softmax_input_output_and_error_formats():
    torch.manual_seed(5)
    x = torch.randn(4, 9, requires_grad=True) * 3
    settings = nearest(input=E4M3, output=BF16, error=E5M2)
    calls = (
        lambda t: torch.softmax(t, -1),
        lambda t: F.softmax(t, dim=-1),
        lambda t: torch.special.softmax(t, -1),
    )
    for call in calls:
        with quantize_functions(nn.Identity(), {"softmax": settings}):
            got = call(x)
        (grad,) = torch.autograd.grad(got, x, torch.linspace(-1, 1, 36).reshape(4, 9))
        xq = lpsim.quantize(x.detach(), E4M3).requires_grad_()
        expected = torch.softmax(xq, -1)
        g = lpsim.quantize(torch.linspace(-1, 1, 36).reshape(4, 9), E5M2)
        (expected_grad,) = torch.autograd.grad(expected, xq, g)
        assert_same_bits(got.detach(), lpsim.quantize(expected.detach(), BF16))
        assert_same_bits(grad, expected_grad)


# ---- Attention: the scores and context products are on the format's grid.


def test_scaled_dot_product_attention_scores_and_context_are_on_the_grid():
    torch.manual_seed(6)
    model, x = Attention(), torch.randn(2, 8, 32)
    config = {
        "attention.scores": nearest(output=E4M3),
        "attention.context": nearest(input=E5M2, output=E4M3),
    }
    recorder = Recorder()
    with recorder, quantize_functions(model, config):
        out = model(x)
    ((scores, probabilities),) = recorder.named("softmax")
    assert on_grid(scores * 4, E4M3)  # the scores times 1/4, exact
    assert not on_grid(probabilities, E5M2)  # the softmax is torch's, in float32
    assert on_grid(out, E4M3)
    products = recorder.named("matmul")
    assert len(products) == 2
    assert on_grid(products[1][0], E5M2)  # the context's first operand: the probabilities


def test_attention_operands_with_axis_minus_2_are_scaled_along_the_reduction():
    """k^T and v are the second operands (K, N): an MX format with axis=-2 has blocks along
    head_dim for k and along the keys for v (the last block of 37 keys holds 5), as k and v
    quantised along their own reduction axes; q and p take axis -1."""
    torch.manual_seed(17)
    mx = preset("mxfp8_e4m3")
    along_k = dataclasses.replace(mx, axis=-2)
    q, k, v = torch.randn(2, 3, 5, 64), torch.randn(2, 3, 37, 64), torch.randn(2, 3, 37, 64)
    k, v = k * torch.exp(3 * torch.randn(2, 3, 37, 1)), v * torch.exp(3 * torch.randn(2, 3, 1, 64))
    product = nearest(input=mx, weight=along_k)
    config = {"attention.scores": product, "attention.context": product}
    with quantize_functions(nn.Identity(), config):
        got = F.scaled_dot_product_attention(q, k, v)
    k_blocks = lpsim.quantize(k, mx, "nearest").transpose(-2, -1)  # along head_dim
    v_blocks = lpsim.quantize(v.transpose(-2, -1), mx, "nearest").transpose(-2, -1)  # the keys
    scores = (lpsim.quantize(q, mx, "nearest") @ k_blocks) * 0.125
    weights = torch.softmax(scores, dim=-1)
    assert_same_bits(got, lpsim.quantize(weights, mx, "nearest") @ v_blocks)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_scores_and_context_are_on_the_grid(need_weights):
    torch.manual_seed(7)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16)
    config = {
        "attention.scores": nearest(output=E4M3),
        "attention.softmax": nearest(output=E5M2),
        "attention.context": nearest(output=E4M3),
    }
    recorder = Recorder()
    with recorder, quantize_functions(mha, config):
        mha(x, x, x, need_weights=need_weights)
    ((scores, _),) = recorder.named("softmax")
    assert on_grid(scores, E4M3)  # torch scales q before the product
    products = recorder.named("matmul")
    assert len(products) == 2
    assert on_grid(products[1][0], E5M2)  # the weights, rounded by attention.softmax
    context = recorder.named("linear")[-1][0]  # the out projection's input
    assert on_grid(context, E4M3)


def test_transformer_encoder_layer_runs_every_product_as_configured_in_eval_too():
    torch.manual_seed(8)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    config = {"linear": nearest(output=BF16), "attention.scores": nearest(output=E4M3)}
    for training in (True, False):
        layer.train(training)
        recorder = Recorder()
        with torch.no_grad(), recorder, quantize_functions(layer, config):
            out = layer(x)
        ((scores, _),) = recorder.named("softmax")
        assert on_grid(scores, E4M3)
        assert not on_grid(out, BF16)  # the layer norm's output is torch's
        plain = layer(x)
        assert not torch.equal(out, plain)


def test_a_key_selecting_multihead_attentions_out_proj_decides_its_out_projection():
    """nn.MultiheadAttention passes out_proj's weight and bias to F.multi_head_attention_forward
    instead of calling out_proj: its out projection is decided as a call made while out_proj runs,
    at a site of its own; the in projection, made by the attention itself, is not selected."""
    torch.manual_seed(21)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    attention = layer.self_attn
    expected = lpsim.quantize(attention(x, x, x, need_weights=False)[0], E4M3)
    with quantize_functions(attention, {("linear", "out_proj"): nearest(output=E4M3)}):
        got = attention(x, x, x, need_weights=False)[0]
    assert_same_bits(got, expected)
    config = {("linear", "self_attn.out_proj"): nearest(output=DelayedScaling(E4M3))}
    with quantize_functions(layer, config) as functions:
        got = layer(x)
    assert list(functions.scalers) == ["0:self_attn/out_proj:linear:0:output"]
    assert not torch.equal(got, layer(x))


# ---- Selection.


def test_a_module_running_in_another_thread_does_not_select_this_threads_calls():
    """torch's function modes are per thread: a submodule run by another thread meanwhile is not
    a running module of the calls made in the thread that entered the context."""
    started, release = threading.Event(), threading.Event()

    class Waiting(nn.Module):
        def forward(self, x):
            started.set()
            release.wait(30)
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.waiting = Waiting()

        def forward(self, x):
            return x @ x.T

    model, x = Model(), torch.randn(4, 8)
    with quantize_functions(model, {("matmul", "waiting"): nearest(output=E4M3)}):
        other = threading.Thread(target=model.waiting, args=(x,))
        other.start()
        assert started.wait(30)
        try:
            got = model(x)
        finally:
            release.set()
            other.join()
    assert_same_bits(got, x @ x.T)


def test_the_calls_of_a_modules_forward_hooks_are_made_while_it_runs():
    """A module runs from its first forward pre-hook to its last forward hook: a pair key
    selecting it decides the calls of both (before, those of its pre-hooks were its parent's)."""
    torch.manual_seed(24)
    model, x, p = nn.Sequential(nn.Identity()), torch.randn(3, 8), torch.randn(8, 8)
    model[0].register_forward_pre_hook(lambda module, args: (args[0] @ p,))
    model[0].register_forward_hook(lambda module, args, out: out @ p)
    with quantize_functions(model, {("matmul", "0"): nearest(output=E4M3)}):
        got = model(x)
    rounded = lpsim.quantize(x @ p, E4M3)
    assert_same_bits(got, lpsim.quantize(rounded @ p, E4M3))


def test_op_and_module_selectors_choose_the_first_matching_entry():
    torch.manual_seed(9)
    model, x = Products(), torch.randn(3, 5, 8)
    config = {
        ("linear", "b"): nearest(output=E4M3),  # never runs: b's forward is not called
        ("linear", "a"): nearest(output=E5M2),
        "linear": nearest(output=E4M3),
    }
    with quantize_functions(model, config):
        got = model(x)
    y = lpsim.quantize(model.a(x), E5M2) @ model.b.weight
    assert_same_bits(got, torch.softmax(torch.matmul(y, x.transpose(-2, -1)), dim=-1))
    # The products are called by the model itself, under no Linear: a type selector skips them.
    with quantize_functions(model, {("matmul", nn.Linear): nearest(output=E4M3)}):
        got = model(x)
    assert_same_bits(got, model(x))
    with quantize_functions(model, {"matmul": nearest(output=E4M3)}):
        got = model(x)
    y = lpsim.quantize(model.a(x) @ model.b.weight, E4M3)
    s = lpsim.quantize(torch.matmul(y, x.transpose(-2, -1)), E4M3)
    assert_same_bits(got, torch.softmax(s, dim=-1))


def test_attention_steps_fall_back_to_matmul_and_softmax_entries():
    torch.manual_seed(10)
    model, x = Attention(), torch.randn(2, 8, 32)
    with quantize_functions(model, {"matmul": nearest(output=E4M3)}):
        general = model(x)
    config = {
        "attention.scores": nearest(output=E4M3),
        "attention.context": nearest(output=E4M3),
    }
    with quantize_functions(model, config):
        specific = model(x)
    assert_same_bits(general, specific)
    assert on_grid(general, E4M3)


def test_calls_of_modules_inject_gave_macs_are_left_to_inject():
    torch.manual_seed(11)
    layer = nn.Linear(64, 4)
    x = torch.randn(3, 64)
    injected = copy.deepcopy(layer)
    # A native forward product (a torch.matmul, which the context sees) with a simulated weight
    # gradient.
    inject(injected, {nn.Linear: LayerQuantization(weight_grad_mac=BF16_MAC)})
    expected = injected(x)
    config = {"linear": nearest(output=E4M3), "matmul": nearest(output=E4M3)}
    with quantize_functions(injected, config):
        got = injected(x)
    assert_same_bits(got, expected)
    assert not on_grid(got, E4M3)


# ---- Rules and randomness.


def test_eval_mode_replaces_stochastic_rules_by_eval_rounding():
    torch.manual_seed(12)
    model, x = Products(), torch.randn(3, 5, 8)
    stochastic = {"softmax": LayerQuantization(output=E4M3)}  # stochastic by default
    model.eval()
    with quantize_functions(model, stochastic):
        got = model(x)
    with quantize_functions(model, {"softmax": nearest(output=E4M3)}):
        expected = model(x)
    assert_same_bits(got, expected)


def test_stochastic_rounding_follows_torch_manual_seed():
    model, x = Products(), torch.randn(3, 5, 8)
    config = {
        "matmul": LayerQuantization(output=E4M3, mac=MAC(accumulator=BF16, rounding="stochastic"))
    }
    results = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        with quantize_functions(model, config):
            results.append(model(x))
    assert_same_bits(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def assert_compiled_gives_the_eager_bits(model, x, config, context_of_compiled=False) -> None:
    """model(x) compiled (aot_eager) inside a quantize_functions context of ``config`` gives the
    bits of the eager call; the context is the model's, or with ``context_of_compiled`` the
    compiled wrapper's."""
    with quantize_functions(model, config):
        eager = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with quantize_functions(compiled if context_of_compiled else model, config):
        assert_same_bits(compiled(x), eager)


def test_compiled_model_gives_the_eager_bits():
    """Dynamo traces through the context (aot_eager: the traced graph run by torch's eager
    kernels; Inductor's generated softmax and fused scaling may differ in the last bit)."""
    torch.manual_seed(13)
    model, x = Attention(width=16, heads=1), torch.randn(1, 4, 16)
    config = {"attention.scores": nearest(output=E4M3), "linear": nearest(input=E5M2)}
    assert_compiled_gives_the_eager_bits(model, x, config)


def test_a_module_selector_compiled_gives_the_eager_bits():
    torch.manual_seed(22)
    model, x = Products(), torch.randn(3, 5, 8)
    config = {("linear", "a"): nearest(output=E4M3), ("matmul", Products): nearest(output=E5M2)}
    assert_compiled_gives_the_eager_bits(model, x, config)


def test_torch_compiles_wrapper_stands_for_the_model_it_wraps():
    """The wrapper's forward runs the wrapped model's modules, which the context hooks and
    selectors name as in the model."""
    torch.manual_seed(23)
    model, x = Products(), torch.randn(3, 5, 8)
    config = {("linear", "a"): nearest(output=E4M3), "matmul": nearest(output=E5M2)}
    assert_compiled_gives_the_eager_bits(model, x, config, context_of_compiled=True)


def test_a_masked_softmax_input_format_compiled_gives_the_eager_bits():
    torch.manual_seed(14)
    model, x = Attention(width=16, heads=1), torch.randn(1, 4, 16)
    config = {"attention.softmax": nearest(input=Float(4, 3, special="fn"))}
    assert_compiled_gives_the_eager_bits(model, x, config)


def test_hooks_are_removed_on_exit_and_the_context_is_not_reentrant():
    model = Products()
    functions = quantize_functions(model, {"matmul": nearest(output=E4M3)})
    with functions:
        assert model.a._forward_pre_hooks
        with pytest.raises(RuntimeError, match="already active"):
            functions.__enter__()
    assert not model.a._forward_pre_hooks and not model.a._forward_hooks
    with functions:  # and it can be entered again
        model(torch.randn(2, 3, 8))


# ---- Delayed scaling: one amax history per call site, saved and restored.

DELAYED = DelayedScaling(E4M3, history_length=4)


def by_hand(model, x, scalers, record=True):
    """Products.forward with both products' first operands through the given DelayedScalers."""
    y = scalers[0](model.a(x), "nearest", record=record) @ model.b.weight
    z = torch.matmul(scalers[1](y, "nearest", record=record), x.transpose(-2, -1))
    return torch.softmax(z, dim=-1)


def test_delayed_scaling_keeps_one_amax_history_per_call_site():
    torch.manual_seed(14)
    model = Products()
    functions = quantize_functions(model, {"matmul": nearest(input=DELAYED)})
    scalers = [DELAYED.scaler(), DELAYED.scaler()]
    for step in range(5):
        x = torch.randn(3, 5, 8) * (step + 1)
        with functions:
            got = model(x)
        assert_same_bits(got, by_hand(model, x, scalers))
    sites = sorted(functions.scalers.keys())
    assert sites == ["0::matmul:0:input", "0::matmul:1:input"]
    for key, scaler in zip(sites, scalers):
        assert_same_bits(functions.scalers[key].amax_history, scaler.amax_history)
    model.eval()  # eval quantises with the scale, records nothing
    with functions:
        got = model(x)
    assert_same_bits(got, by_hand(model, x, scalers, record=False))
    assert int(functions.scalers[sites[0]].calls) == 5


def test_delayed_scaling_state_dict_resumes_the_histories():
    torch.manual_seed(15)
    model, config = (
        Products(),
        {"matmul": nearest(input=DELAYED), "softmax": nearest(error=DELAYED)},
    )
    inputs = [torch.randn(3, 5, 8) * (i + 1) for i in range(4)]
    first = quantize_functions(model, config)
    for x in inputs[:2]:
        with first:
            model(x).sum().backward()
    saved = copy.deepcopy(first.state_dict())
    resumed = quantize_functions(model, config)
    resumed.load_state_dict(saved)
    for x in inputs[2:]:
        outputs = []
        for functions in (first, resumed):
            with functions:
                y = model(x)
            (grad,) = torch.autograd.grad(y.square().sum(), model.a.weight)
            outputs.append((y, grad))
        assert_same_bits(outputs[0][0], outputs[1][0])
        assert_same_bits(outputs[0][1], outputs[1][1])
    assert first.state_dict().keys() == resumed.state_dict().keys()
    assert "1::softmax:0:error" in first.scalers  # the error's history, recorded in backward
    with pytest.raises(KeyError, match="no DelayedScaling"):
        resumed.load_state_dict({"0::matmul:0:output": saved["0::matmul:0:input"]})


def test_loading_makes_the_scalers_on_the_model_s_device_not_the_checkpoint_s():
    """A checkpoint read onto the CPU (map_location="cpu", as the trainers read theirs) must
    resume a run whose model lives elsewhere: the scalers loading makes are on the model's
    device, where its calls quantise (they were made on the checkpoint's, and the first call on
    a GPU then raised). The meta device stands in for a second device here."""
    torch.manual_seed(15)
    model, config = Products(), {"matmul": nearest(input=DELAYED)}
    first = quantize_functions(model, config)
    with first:
        model(torch.randn(3, 5, 8)).sum().backward()
    saved = copy.deepcopy(first.state_dict())
    assert {state["scale"].device.type for state in saved.values()} == {"cpu"}
    elsewhere = Products().to("meta")
    resumed = quantize_functions(elsewhere, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: copying into a meta tensor is a no-op
        resumed.load_state_dict(saved)
    assert resumed.scalers.keys() == first.scalers.keys()
    for scaler in resumed.scalers.values():
        assert {t.device.type for t in scaler.state_dict().values()} == {"meta"}


def test_delayed_scaling_of_attention_steps_has_a_site_per_step():
    torch.manual_seed(16)
    model, x = Attention(), torch.randn(2, 8, 32)
    config = {
        "attention.scores": nearest(input=DELAYED, weight=DELAYED),
        "attention.context": nearest(input=DELAYED, error=DELAYED),
    }
    functions = quantize_functions(model, config)
    for _ in range(2):
        with functions:
            model(x).sum().backward()
    assert sorted(functions.scalers.keys()) == [
        "0::attention/scores:0:input",
        "0::attention/scores:0:weight",
        "1::attention/context:0:error",
        "1::attention/context:0:input",
    ]
    assert all(int(scaler.calls) == 2 for scaler in functions.scalers.values())


# ---- Errors name what is wrong.


@pytest.mark.parametrize(
    "config, error, match",
    [
        ({"conv": LayerQuantization()}, ValueError, "unknown op 'conv'"),
        ({"softmax": nearest(weight=E4M3)}, ValueError, "sets weight"),
        ({"softmax": LayerQuantization(mac=BF16_MAC)}, ValueError, "sets mac"),
        ({"matmul": nearest(bias=E4M3)}, ValueError, "sets bias"),
        ({"matmul": E4M3}, TypeError, "must be a LayerQuantization"),
        ({("matmul", 3): LayerQuantization()}, TypeError, "config keys"),
        ({3: LayerQuantization()}, TypeError, "op names or"),
    ],
)
def test_malformed_configs_raise_errors_that_name_the_problem(config, error, match):
    with pytest.raises(error, match=match):
        quantize_functions(nn.Identity(), config)


def test_a_selector_that_matches_no_module_is_refused():
    """A misspelt name, or a two-op key read as (op, module name), would quantise nothing."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    for key in [("linear", "softmax"), ("matmul", "2"), ("linear", nn.Conv2d)]:
        with pytest.raises(ValueError, match="selects no module of the model"):
            quantize_functions(model, {key: LayerQuantization()})
    for key in [("linear", "0"), ("linear", "1"), ("softmax", ""), ("linear", nn.Softmax)]:
        quantize_functions(model, {key: LayerQuantization()})  # the model itself is "", too


def test_a_predicate_that_raises_on_entering_names_itself_and_leaves_the_context_usable():
    """A predicate that matches a first module passes the construction check and then fails on
    another when the context is entered: the error did not say which selector on which module,
    and the context stayed marked active, refusing every later entry ("already active")."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def wide(name, module):
        return name == "" or module.in_features > 3

    spec = (Float(4, 3), "nearest")
    context = quantize_functions(model, {("linear", wide): LayerQuantization(output=spec)})
    with pytest.raises(AttributeError, match="in_features") as raised, context:
        pass
    assert raised.value.__notes__ == [
        "quantize_functions: raised by the selector wide on the module '1' (ReLU)"
    ]
    del model[1]  # the predicate now answers on every module
    x = torch.randn(2, 4)
    with context:
        got = model(x)
    want = F.linear(x, model[0].weight, model[0].bias).detach()
    assert_same_bits(got, want.to(torch.float8_e4m3fn).float())


class _WeightsBorrowed(nn.Module):
    """Uses its child's weights without calling it, as nn.MultiheadAttention does its out_proj."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(x, self.inner.weight, self.inner.bias)


def test_a_key_that_decides_no_call_warns_once_when_the_context_exits():
    """A selector that matches a module which never runs (its parent borrows its weights) passes
    the construction check and would quantise nothing, silently."""
    model = _WeightsBorrowed()
    settings = LayerQuantization(input=Float(5, 2), rounding="nearest")
    functions = quantize_functions(model, {("linear", "inner"): settings, "linear": settings})
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with functions:
                y = model(x)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "quantize_functions: the key ('linear', 'inner') has decided no call: no 'linear' call "
        "was made while a module its selector selects runs (outside modules inject gave MACs), "
        "so it quantised nothing"
    ]
    assert caught[0].filename == __file__
    expected = F.linear(lpsim.quantize(x, Float(5, 2)), model.inner.weight, model.inner.bias)
    assert_same_bits(y, expected)  # the op key decided the call


def test_a_context_left_by_an_exception_does_not_warn():
    functions = quantize_functions(nn.Identity(), {"softmax": LayerQuantization()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError), functions:
            raise KeyError("stop")


def test_a_model_and_a_mapping_are_required():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        quantize_functions(lambda x: x, {})
    with pytest.raises(TypeError, match="config must be a mapping"):
        quantize_functions(nn.Identity(), [("matmul", LayerQuantization())])


def test_a_matmul_with_out_is_refused_when_simulated():
    a, b, out = torch.ones(2, 2), torch.ones(2, 2), torch.empty(2, 2)
    with quantize_functions(nn.Identity(), {"matmul": nearest(output=E4M3)}):
        with pytest.raises(ValueError, match="two operands only"):
            torch.matmul(a, b, out=out)


@pytest.mark.parametrize("call", [torch.matmul, torch.mm, torch.linalg.matmul])
def test_a_matmul_with_out_none_is_simulated_as_without_it(call):
    """out=None gives no out tensor: the call is the plain one, not refused."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with quantize_functions(nn.Identity(), {"matmul": nearest(output=E4M3)}):
        got, want = call(a, b, out=None), call(a, b)
    assert_same_bits(got, want)
    assert on_grid(got, E4M3)


def test_a_softmax_with_out_is_refused_when_simulated_not_left_unquantised():
    """torch.softmax takes out=: the context returned the quantised result while the out tensor
    held torch's unquantised softmax, silently. A softmax no entry selects keeps torch's out=."""
    x, out = torch.randn(3, 5), torch.empty(3, 5)
    with quantize_functions(nn.Identity(), {"softmax": nearest(output=E4M3)}):
        with pytest.raises(ValueError, match="with out= is not simulated"):
            torch.softmax(x, -1, out=out)
    with quantize_functions(nn.Identity(), {"matmul": nearest(output=E4M3)}):
        got = torch.softmax(x, -1, out=out)
        x @ x.t()  # the entry decides a call
    assert got is out
    assert_same_bits(out, torch.softmax(x, -1))


@pytest.mark.parametrize(
    "call, keywords",
    [
        (torch.matmul, ("input", "other")),
        (torch.mm, ("input", "mat2")),
        (torch.Tensor.matmul, ("other",)),
        (torch.Tensor.mm, ("mat2",)),
    ],
)
def test_a_matmul_with_operands_given_by_keyword_is_simulated(call, keywords):
    """torch.matmul(input=a, other=b) is torch's valid call; it was refused as if it had out=."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    operands = dict(zip(keywords, (a, b)[-len(keywords) :]))
    positional = (a,) if len(keywords) == 1 else ()
    with quantize_functions(nn.Identity(), {"matmul": nearest(input=E4M3, output=E4M3)}):
        got = call(*positional, **operands)
    expected = lpsim.quantize(lpsim.quantize(a, E4M3, "nearest") @ b, E4M3, "nearest")
    assert_same_bits(got, expected)


@pytest.mark.parametrize(
    "call, shapes",
    [
        (torch.mm, [(2, 3, 4), (2, 4, 5)]),
        (torch.mm, [(4,), (4, 5)]),
        (torch.Tensor.mm, [(3, 4), (4,)]),
        (torch.bmm, [(2, 3, 4), (1, 4, 5)]),
        (torch.bmm, [(3, 4), (4, 5)]),
        (torch.Tensor.bmm, [(2, 3, 4), (4, 5)]),
    ],
)
def test_simulated_mm_and_bmm_refuse_the_shapes_torch_refuses(call, shapes):
    a, b = (torch.randn(*shape) for shape in shapes)
    with pytest.raises(RuntimeError):
        call(a, b)  # torch's own
    with quantize_functions(nn.Identity(), {"matmul": nearest(input=E4M3)}):
        with pytest.raises(ValueError, match="mm takes"):
            call(a, b)  # not a broadcast matmul


def test_softmax_with_its_input_as_keyword_is_simulated():
    x = torch.randn(3, 5)
    want = lpsim.quantize(torch.softmax(lpsim.quantize(x, E4M3), -1), E5M2)
    with quantize_functions(nn.Identity(), {"softmax": nearest(input=E4M3, output=E5M2)}):
        got = torch.softmax(input=x, dim=-1)
    assert_same_bits(got, want)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: torch.softmax(t, -1, dtype=torch.float32),
        lambda t: F.softmax(t, dim=-1, dtype=torch.float32),
        lambda t: F.softmax(t, -1, 3, torch.float32),
        lambda t: t.softmax(-1, torch.float32),
        lambda t: torch.special.softmax(t, -1, dtype=torch.float32),
    ],
    ids=["torch", "functional", "functional-positional", "method", "special"],
)
def test_softmax_with_dtype_rounds_its_input_in_that_dtype_as_torch_casts_it_first(call):
    """A float16 input to softmax(dtype=float32) with a bfloat16-range input format: the format
    rounds the input cast to float32 (float16 cannot hold it), and the result is float32."""
    x = torch.randn(3, 7, dtype=torch.float16) * 4
    with quantize_functions(nn.Identity(), {"softmax": nearest(input=BF16, output=E5M2)}):
        got = call(x)
    expected = lpsim.quantize(torch.softmax(lpsim.quantize(x.float(), BF16), -1), E5M2)
    assert got.dtype == torch.float32
    assert_same_bits(got, expected)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b, c: torch.einsum("ij,jk->ik", a, b),
        lambda a, b, c: torch.addmm(c, a, b),
        lambda a, b, c: torch.baddbmm(c[None], a[None], b[None]),
        lambda a, b, c: torch.log_softmax(a, -1),
        lambda a, b, c: F.log_softmax(a, dim=-1),
    ],
    ids=["einsum", "addmm", "baddbmm", "log_softmax", "functional-log_softmax"],
)
def test_functions_the_docs_do_not_list_are_torchs_own_bit_for_bit(call):
    a, b, c = torch.randn(3, 4) * 3, torch.randn(4, 5), torch.randn(3, 5)
    settings = nearest(input=E4M3, weight=E4M3, output=E4M3)
    config = {"matmul": settings, "linear": settings, "softmax": nearest(input=E4M3)}
    with quantize_functions(nn.Identity(), config):
        got = call(a, b, c)
    assert_same_bits(got, call(a, b, c))


@pytest.mark.parametrize("size", [16, 512], ids=["matrix", "butterfly"])
def test_a_random_hadamard_transform_in_the_context_is_not_a_simulated_product(size):
    """RandomHadamard.apply multiplies each group by its matrix (up to size 256): its own
    arithmetic, which a "matmul" entry rounded as a model's product (its operands, its result on
    E4M3's grid). The transform is the same inside the context as outside, and near the float64
    product by R."""
    transform = lpsim.RandomHadamard(size, seed=3)
    x = torch.randn(4, 2 * size)
    want = transform.apply(x)
    exact = (x.double().reshape(4, 2, size) @ transform.matrix(torch.float64).T).reshape(4, -1)
    torch.testing.assert_close(want.double(), exact, rtol=1e-5, atol=1e-5)
    functions = quantize_functions(
        nn.Identity(), {"matmul": nearest(input=E4M3, weight=E4M3, output=E4M3, mac=FP16_MAC)}
    )
    with functions:
        got, back = transform.apply(x), transform.inverse(want)
        quantised = x @ x.t()  # the context's own products are still simulated
    assert_same_bits(got, want, "apply")
    assert_same_bits(back, transform.inverse(want), "inverse")
    assert on_grid(quantised, E4M3)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, w, b: LF.linear(x, w, b, input_grad_mac=FP16_MAC),
        lambda x, w, b: LF.linear(x, w, weight_grad_mac=FP16_MAC),
        lambda x, w, b: LF.linear(x, w, b, input_grad_operands=LF.Operands(error=E5M2)),
        lambda x, w, b: LF.matmul(x, w.t(), weight_grad_operands=LF.Operands(input=E5M2)),
        lambda x, w, b: LF.bmm(x[None], w.t()[None], input_grad_mac=FP16_MAC),
        lambda x, w, b: LF.conv1d(x[None], w[:, :4, None], b, input_grad_mac=FP16_MAC),
    ],
    ids=["linear-bias", "linear", "linear-operands", "matmul-operands", "bmm", "conv1d"],
)
def test_a_simulated_functional_products_own_torch_calls_are_not_the_contexts(call):
    """lpsim.nn.functional computes the forward product of a function whose backward products
    are simulated by torch's op (native forward MAC): its own arithmetic, which a context's
    "linear" and "matmul" entries rounded as a model's call (the forward only: the backward
    products are outside the context), silently. The result is the same inside as outside, and
    the context still decides the model's own calls and functions whose products are all torch's
    (torch's op itself)."""
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=g) for s in ((4, 16), (8, 16), (8,)))
    want = call(x, w, b)
    settings = nearest(output=Float(2, 1))
    with quantize_functions(nn.Identity(), {"linear": settings, "matmul": settings}):
        got = call(x, w, b)
        native = LF.linear(x, w, b)  # torch's F.linear itself: the context's call
    assert_same_bits(got, want)
    assert on_grid(native, Float(2, 1))


@pytest.mark.parametrize("mac", [None, BF16_MAC])
def test_integer_products_are_torchs_own_and_take_no_site(mac):
    """An integer product has nothing to simulate: torch computes it exactly, under any MAC, and
    it does not shift the ranks of the float products' sites."""
    a, b = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (4, 2))
    x = torch.randn(3, 4)
    functions = quantize_functions(nn.Identity(), {"matmul": nearest(input=DELAYED, mac=mac)})
    with functions:
        products = [torch.matmul(a, b), a @ b, a.mm(b), torch.bmm(a[None], b[None])[0]]
        x @ x.t()
    for product in products:
        assert product.dtype == torch.int64 and torch.equal(product, a @ b)
    assert list(functions.scalers.keys()) == ["0:<outside>:matmul:0:input"]


@pytest.mark.parametrize("field", ["input", "weight", "bias", "output", "error"])
def test_a_format_on_a_complex_operand_or_result_is_refused_not_skipped(field):
    """lpsim's formats do not round complex tensors: a format that would apply to one is an error
    naming the field, as inject's is, not a product left unrounded."""
    a, w, b = (torch.randn(*s, dtype=torch.complex64) for s in ((3, 4), (2, 4), (2,)))
    calls = {"linear": lambda: F.linear(a, w, b), "matmul": lambda: torch.matmul(a, w.T)}
    for op, call in calls.items():
        if op == "matmul" and field == "bias":
            continue
        refused = f"the {field} of a '{op}' call is a torch.complex64"
        with quantize_functions(nn.Module(), {op: nearest(**{field: E4M3})}):
            with pytest.raises(TypeError, match=refused):
                call()


@pytest.mark.parametrize("mac", [None, BF16_MAC])
def test_integer_linear_calls_are_torchs_own_and_take_no_site(mac):
    """As integer matmuls: F.linear of integer tensors is torch's exact product under any
    settings (no output format, MAC or error applied), and the float call after it keeps rank 0."""
    a, w, bias = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (2, 4)), torch.arange(2)
    x = torch.randn(3, 4)
    settings = nearest(input=DELAYED, output=E4M3, error=E5M2, mac=mac)
    functions = quantize_functions(nn.Identity(), {"linear": settings})
    with functions:
        products = [F.linear(a, w), F.linear(a, w, bias), F.linear(input=a, weight=w)]
        F.linear(x, x)
    for product, want in zip(products, [a @ w.t(), a @ w.t() + bias, a @ w.t()]):
        assert product.dtype == torch.int64 and torch.equal(product, want)
    assert list(functions.scalers.keys()) == ["0:<outside>:linear:0:input"]


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_attention_rows_no_key_takes_part_in_give_zeros_and_zero_gradients_as_torch(mask_dtype):
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False  # query 1 sees no key
    if mask_dtype != torch.bool:
        mask = torch.zeros(3, 3).masked_fill(~mask, float("-inf"))
    config = {"attention.softmax": nearest(output=E4M3)}
    with quantize_functions(nn.Identity(), config):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    y.sum().backward()
    assert_same_bits(y[:, :, 1], torch.zeros(1, 2, 4))
    assert_same_bits(q.grad[:, :, 1], torch.zeros(1, 2, 4))
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    torch_y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_same_bits(torch_y[:, :, 1], torch.zeros(1, 2, 4))  # what torch gives


@pytest.mark.parametrize("mac", [None, BF16_MAC])
def test_nested_contexts_quantise_a_call_once_by_the_innermost_that_selects_it(mac):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    outer = {
        "matmul": nearest(input=E5M2, output=lpsim.Fixed(4, 1)),
        "softmax": nearest(output=E5M2),
    }
    inner = {"matmul": nearest(input=E4M3, mac=mac)}
    with quantize_functions(nn.Identity(), inner):
        want = a @ b
    with quantize_functions(nn.Identity(), outer):
        with quantize_functions(nn.Identity(), inner):
            got = a @ b
            softmax = torch.softmax(a, -1)  # not the inner's: the outer decides it
    assert_same_bits(got, want)
    assert_same_bits(softmax, lpsim.quantize(torch.softmax(a, -1), E5M2, "nearest"))


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        # the inner simulates the attention's scores; the projections are the outer's
        ({"linear": nearest(input=E5M2, output=E4M3)}, {"attention.scores": nearest(input=E4M3)}),
        # the inner simulates the projections; the attention steps are the outer's
        (
            {"attention.softmax": nearest(output=E4M3), "matmul": nearest(input=E5M2)},
            {"linear": nearest(weight=E4M3)},
        ),
    ],
    ids=["outer-projections", "outer-steps"],
)
def test_a_call_the_inner_context_does_not_select_inside_its_simulation_is_the_outers(outer, inner):
    """Nested contexts act as one with the inner's entries first: the calls an inner context's
    simulation of an enclosing call (attention) makes, and that it does not select, are decided
    by the context further out, as that context would decide them on its own."""
    torch.manual_seed(3)
    model = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    with quantize_functions(model, {**inner, **outer}):
        want, _ = model(x, x, x, need_weights=False)
    with quantize_functions(model, outer), quantize_functions(model, inner):
        got, _ = model(x, x, x, need_weights=False)
    assert_same_bits(got, want)
    with quantize_functions(model, inner):
        inner_only, _ = model(x, x, x, need_weights=False)
    assert not torch.equal(got, inner_only)  # the outer's entries took part


def test_a_call_outside_the_models_modules_keeps_one_site_when_the_context_is_entered_per_step():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    functions = quantize_functions(nn.Identity(), {"matmul": nearest(input=DELAYED)})
    for _ in range(3):
        with functions:
            a @ b
    assert list(functions.scalers.keys()) == ["0:<outside>:matmul:0:input"]
    assert int(functions.scalers["0:<outside>:matmul:0:input"].calls) == 3
    with functions:  # the documented pitfall: a loop inside one entry
        for _ in range(2):
            a @ b
    assert sorted(functions.scalers.keys()) == [
        "0:<outside>:matmul:0:input",
        "0:<outside>:matmul:1:input",
    ]


def test_a_call_outside_the_model_keeps_its_own_history_apart_from_the_models_forward():
    """The model's own forward (module name "") and the caller outside it each have a site
    "matmul, rank 0": one shared history let the outside tensor's amax set the model's scale."""
    torch.manual_seed(16)
    model = Products()
    functions = quantize_functions(model, {"matmul": nearest(input=DELAYED)})
    scalers = [DELAYED.scaler(), DELAYED.scaler()]
    for _ in range(3):
        x = torch.randn(3, 5, 8)
        with functions:
            got = model(x)
            (1000 * got) @ torch.ones(5, 2)  # the loss's product, outside the model
        assert_same_bits(got, by_hand(model, x, scalers))
    assert sorted(functions.scalers.keys()) == [
        "0::matmul:0:input",
        "0::matmul:1:input",
        "0:<outside>:matmul:0:input",
    ]
    assert int(functions.scalers["0:<outside>:matmul:0:input"].calls) == 3


@pytest.mark.parametrize("dropout_p", [-0.5, float("nan"), 1.5])
def test_attention_refuses_a_dropout_p_outside_0_1_naming_it(dropout_p):
    """A negative or NaN dropout_p ran the attention without dropout, silently."""
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    functions = quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()})
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"), functions:
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def test_attention_refuses_an_integer_mask_as_torch_does():
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # torch's own
    with quantize_functions(nn.Identity(), {"attention.softmax": nearest(output=E4M3)}):
        with pytest.raises(TypeError, match="attn_mask must be bool"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # not added as 1s


def test_attention_takes_the_mask_dtypes_torch_takes_and_refuses_the_others():
    """torch takes a bool mask, a float32 one or one of the query's dtype. A float32 mask on
    bfloat16 scores is added as torch's in-place add_ adds it (in float32, rounded once to
    bfloat16): the steps stay bfloat16, as the docs state; a float16 mask on float32 queries is
    refused, as torch refuses it, not added."""
    torch.manual_seed(20)
    q, k, v = (torch.randn(2, 2, 5, 8).bfloat16() for _ in range(3))
    mask = torch.randn(5, 5)
    with quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()}):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(8))  # the documented steps, by hand
    scores = scores.clone().add_(mask)  # torch's in-place addition of the float32 mask
    expected = torch.softmax(scores, dim=-1) @ v
    assert expected.dtype == torch.bfloat16
    assert_same_bits(got, expected)
    q32, k32, v32 = q.float(), k.float(), v.float()
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask.half())  # torch's own
    with quantize_functions(nn.Identity(), {"attention.scores": LayerQuantization()}):
        with pytest.raises(TypeError, match="attn_mask must be bool .*float32 or the query"):
            F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask.half())


def test_a_site_first_met_under_inference_mode_trains_afterwards():
    """Its scaler holds ordinary tensors: made as inference tensors, the next training pass could
    not update them ('Inplace update to inference tensor outside InferenceMode')."""
    model = nn.Linear(4, 4)
    config = {"matmul": LayerQuantization(input=DelayedScaling(lpsim.Float(4, 3)))}
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    functions = lpsim.nn.quantize_functions(model, config)
    with torch.inference_mode(), functions:
        a @ b
    with functions:
        y = a @ b
    assert torch.isfinite(y).all()


def test_a_shared_module_is_selected_by_either_of_its_names():
    """nn.Module.named_modules names a module registered twice once, by its first name; a
    pattern on the second name selected nothing, silently."""

    class Square(nn.Module):
        def forward(self, a):
            return a @ a

    shared = Square()
    model = nn.Sequential()
    model.add_module("first", shared)
    model.add_module("second", shared)
    x = torch.full((2, 2), 0.3)
    fmt = Float(5, 2)
    config = {("matmul", "second"): LayerQuantization(output=(fmt, "nearest"))}
    with lpsim.nn.quantize_functions(model, config):
        y = model(x)
    once = lpsim.quantize(x @ x, fmt, "nearest")
    assert torch.equal(y, lpsim.quantize(once @ once, fmt, "nearest"))


MASKING_FORMATS = [
    Float(2, 1, special="none", saturate=True),  # no Inf: -inf would saturate to -6
    Float(4, 3, special="fn"),  # no Inf: -inf would be NaN
    preset("mxfp8_e4m3"),  # an amax of inf would make the block's scale NaN
]


@pytest.mark.parametrize("fmt", MASKING_FORMATS, ids=["fp4", "e4m3fn", "mxfp8"])
def test_masked_scores_stay_masked_under_a_softmax_input_format(fmt):
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 4, 32) for _ in range(3))
    config = {"attention.softmax": nearest(input=fmt)}
    with quantize_functions(nn.Identity(), config):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        later = v.clone()
        later[..., 1:, :] += 100.0  # what query 0 must not see
        query_0 = F.scaled_dot_product_attention(q, k, later, is_causal=True)[..., 0, :]
    assert_same_bits(query_0, got[..., 0, :])
    # The scores that take part are rounded as a tensor whose masked positions are zeros.
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(32))
    rounded = lpsim.quantize(scores.masked_fill(~allowed, 0.0), fmt)
    expected = torch.softmax(rounded.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    assert_same_bits(got, expected)


@pytest.mark.parametrize("fmt", MASKING_FORMATS, ids=["fp4", "e4m3fn", "mxfp8"])
def test_a_causal_float_mask_of_multihead_attention_stays_a_mask_under_a_softmax_format(fmt):
    torch.manual_seed(12)
    mha = nn.MultiheadAttention(32, 2, batch_first=True)
    x = torch.randn(2, 5, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(5)  # float, -inf above the diagonal
    later = x.clone()
    later[:, 1:] += 10.0  # the keys and values query 0 must not see
    with quantize_functions(mha, {"attention.softmax": nearest(input=fmt)}):
        got, _ = mha(x, x, x, attn_mask=mask)
        query_0, _ = mha(x, later, later, attn_mask=mask)
    assert not got.isnan().any()
    assert_same_bits(query_0[:, 0], got[:, 0])


def test_a_state_dict_key_that_names_no_entry_raises_key_error():
    functions = quantize_functions(nn.Identity(), {"softmax": nearest(input=E4M3)})
    with pytest.raises(KeyError, match="no entry"):
        functions.load_state_dict({"x:softmax:0:input": {"scale": torch.tensor(1.0)}})


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch_save"])
def test_a_model_copied_inside_an_active_context_is_a_plain_model(how):
    # Pickling a model while a context was active (torch.save of the whole model inside the
    # training loop's context, a model sent to a worker process) failed on the context's hooks
    # (a local function); a deep copy got inert hooks. Now every copy gets them: the copy's
    # modules are not the context's model's, so its calls are torch's own.
    torch.manual_seed(31)
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    x = torch.randn(3, 8)
    config = {("linear", "0"): nearest(output=E4M3), ("softmax", "*"): nearest(output=E4M3)}
    functions = quantize_functions(model, config)
    with functions:
        quantized = model(x)
        if how == "deepcopy":
            copied = copy.deepcopy(model)
        elif how == "pickle":
            copied = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            copied = torch.load(buffer, weights_only=False)
        assert_same_bits(copied(x), plain(x))
        assert_same_bits(model(x), quantized)
    assert not torch.equal(quantized, plain(x))
    assert_same_bits(copied(x), plain(x))

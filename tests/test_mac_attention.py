"""Multi-head attention under MACs: lpsim.nn.functional.multi_head_attention_forward and an injected
nn.MultiheadAttention.

Three kinds of proof. With the native MAC in float64 the simulated module must be torch's
MultiheadAttention, forward and gradients, to rounding, for every option torch's forward takes:
this checks the decomposition (projections, heads, masks, bias_k, add_zero_attn, dropout, layouts).
Under rounding MACs, a plain reference that sums every product's terms in the order the
function's docstring states, with the exact lpsim.reference.mac_dot, must give the results and
gradients bit for bit: this checks the order of the additions and which MAC each product uses.
Injected into a TransformerEncoder, the products run under the MACs, in eval mode without
gradients too (where torch would take a fused path), and remove() gives torch's bits back."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import assert_same_bits
from torch import nn

import lpsim
import lpsim.nn.functional as LF
from lpsim import MAC, Float
from lpsim import reference as ref
from lpsim.nn import LayerQuantization

NATIVE = MAC()
FLOAT16 = MAC(accumulator=Float(5, 10))
FLOAT16_PAIRWISE = MAC(accumulator=Float(5, 10), order="pairwise")
BFLOAT16 = MAC(accumulator=Float(8, 7))
BFLOAT16_SR = MAC(accumulator=Float(8, 7), rounding="stochastic")
E6M8 = MAC(accumulator=Float(6, 8))
E6M8_CHUNKED = MAC(accumulator=Float(6, 8), order="chunked", chunk=2)
E8M5 = MAC(accumulator=Float(8, 5))

# ---- With the native MAC in float64: torch's MultiheadAttention, forward and gradients.

EMBED, HEADS, TARGET, SOURCE, BATCH = 8, 2, 4, 5, 3

CASES = [
    {},
    {"batch_first": True},
    {"unbatched": True},
    {"unbatched": True, "batch_first": True},
    {"unbatched": True, "attn_mask": "3-D bool", "key_padding_mask": "bool"},
    {"unbatched": True, "attn_mask": "3-D float", "inputs": "cross"},
    {"inputs": "cross"},
    {"inputs": "distinct", "batch_first": True},
    {"kdim": 5, "vdim": 3},
    {"kdim": 5, "vdim": 3, "batch_first": True, "key_padding_mask": "bool"},
    {"key_padding_mask": "bool"},
    {"key_padding_mask": "float"},
    {"attn_mask": "2-D bool"},
    {"attn_mask": "2-D float"},
    {"attn_mask": "3-D bool", "key_padding_mask": "bool"},
    {"attn_mask": "3-D float", "key_padding_mask": "float", "inputs": "cross"},
    {"attn_mask": "causal", "is_causal": True},
    {"attn_mask": "causal", "is_causal": True, "need_weights": False},
    # torch takes the hint itself there: attn_mask dropped, the keys j > i masked among all the
    # keys, bias_k's and add_zero_attn's included (the padded mask would show them to every query).
    {"attn_mask": "causal", "is_causal": True, "need_weights": False, "add_bias_kv": True},
    {"attn_mask": "causal", "is_causal": True, "need_weights": False, "add_zero_attn": True},
    {"attn_mask": "causal", "is_causal": True, "add_bias_kv": True, "key_padding_mask": "bool"},
    {"need_weights": False},
    {"need_weights": False, "attn_mask": "2-D float", "key_padding_mask": "float"},
    {"average_attn_weights": False},
    {"average_attn_weights": False, "unbatched": True},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {
        "add_bias_kv": True,
        "add_zero_attn": True,
        "attn_mask": "2-D bool",
        "key_padding_mask": "bool",
    },
    {"add_bias_kv": True, "add_zero_attn": True, "kdim": 5, "vdim": 3, "attn_mask": "3-D float"},
    {"bias": False},
    {"dropout": 0.3},
    {"dropout": 0.3, "need_weights": False, "batch_first": True, "key_padding_mask": "bool"},
    {"dropout": 0.3, "eval": True},
    # A query no key takes part in: torch's need_weights=False path (scaled_dot_product_attention)
    # gives it weights 0 and zero gradients.
    {"need_weights": False, "key_padding_mask": "bool, a sequence all padding"},
    {"need_weights": False, "attn_mask": "2-D bool, a row all masked", "inputs": "cross"},
]


def make_module(case: dict) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(
        EMBED,
        HEADS,
        dropout=case.get("dropout", 0.0),
        bias=case.get("bias", True),
        add_bias_kv=case.get("add_bias_kv", False),
        add_zero_attn=case.get("add_zero_attn", False),
        kdim=case.get("kdim"),
        vdim=case.get("vdim"),
        batch_first=case.get("batch_first", False),
        dtype=torch.float64,
    )
    with torch.no_grad():
        for p in module.parameters():  # biases too: torch starts them at zero
            p.copy_(torch.randn_like(p) * 0.5)
    return module.train(not case.get("eval", False))


def make_inputs(case: dict) -> tuple[list[torch.Tensor], dict]:
    """(query, key, value) leaves, the same tensor where the case says so, and the keywords."""
    g = torch.Generator().manual_seed(1)
    layout = "distinct" if case.get("kdim") else case.get("inputs", "self")
    unbatched, batch_first = case.get("unbatched", False), case.get("batch_first", False)
    tgt, src = (TARGET, TARGET) if layout == "self" else (TARGET, SOURCE)
    n = 1 if unbatched else BATCH

    def sequence(length: int, dim: int) -> torch.Tensor:
        shape = (length, dim) if unbatched else (BATCH, length, dim)
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        return (t if unbatched or batch_first else t.transpose(0, 1).contiguous()).requires_grad_()

    query = sequence(tgt, EMBED)
    if layout == "self":
        key = value = query
    elif layout == "cross":
        key = value = sequence(src, EMBED)
    else:
        key, value = (
            sequence(src, case.get("kdim") or EMBED),
            sequence(src, case.get("vdim") or EMBED),
        )
    keywords = {
        key: case[key]
        for key in ("need_weights", "average_attn_weights", "is_causal")
        if key in case
    }
    padding = case.get("key_padding_mask")
    if padding is not None:
        shape = (src,) if unbatched else (n, src)
        if padding == "bool":
            mask = torch.zeros(n, src, dtype=torch.bool)
            mask[0, -2:] = True  # the first sequence's last two positions are padding
        elif padding == "bool, a sequence all padding":
            mask = torch.zeros(n, src, dtype=torch.bool)
            mask[0] = True
        else:
            mask = torch.randn(n, src, generator=g, dtype=torch.float64)
        keywords["key_padding_mask"] = mask.reshape(shape)
    attention = case.get("attn_mask")
    if attention == "causal":
        keywords["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(
            tgt, dtype=torch.float64
        )
    elif attention is not None:
        shape = (tgt, src) if attention.startswith("2-D") else (n * HEADS, tgt, src)
        if "bool" in attention:
            mask = torch.rand(shape, generator=g) > 0.6
            mask[..., 0] = False  # no row masked entirely
            if attention.endswith("all masked"):
                mask[..., 1, :] = True
        else:
            mask = torch.randn(shape, generator=g, dtype=torch.float64)
        keywords["attn_mask"] = mask
    return [query, key, value], keywords


def forward_and_gradients(module, inputs, keywords, seed=7):
    """The module's results and the gradients of its inputs and parameters under a fixed
    random weighting of both results."""
    leaves = list({id(t): t for t in inputs}.values())
    torch.manual_seed(seed)
    out, weights = module(*inputs, **keywords)
    g = torch.Generator().manual_seed(2)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=g, dtype=out.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves + list(module.parameters()))
    return out, weights, grads


def simulated(module: nn.MultiheadAttention, mac: MAC = NATIVE) -> nn.MultiheadAttention:
    twin = copy.deepcopy(module)
    lpsim.nn.inject(twin, {nn.MultiheadAttention: LayerQuantization(mac=mac)})
    assert "forward" in vars(twin)  # the simulated forward, not torch's
    return twin


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_native_mac_in_float64_is_torchs_multihead_attention(case):
    module = make_module(case)
    inputs, keywords = make_inputs(case)
    out, weights, grads = forward_and_gradients(simulated(module), inputs, keywords)
    want_out, want_weights, want_grads = forward_and_gradients(module, inputs, keywords)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert (weights is None) == (want_weights is None)
    if weights is not None:
        torch.testing.assert_close(weights, want_weights, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_functional_with_static_keys_and_values_is_torchs():
    module = make_module({})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TARGET, BATCH, EMBED, generator=g, dtype=torch.float64)
    static_k, static_v = (
        torch.randn(BATCH * HEADS, SOURCE, EMBED // HEADS, generator=g, dtype=torch.float64)
        for _ in range(2)
    )
    args = (x, x, x, EMBED, HEADS, module.in_proj_weight, module.in_proj_bias, None, None)
    args += (True, 0.0, module.out_proj.weight, module.out_proj.bias)
    keywords = dict(static_k=static_k, static_v=static_v, average_attn_weights=False)
    got = LF.multi_head_attention_forward(*args, **keywords)
    want = F.multi_head_attention_forward(*args, **keywords)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- Under rounding MACs: every product's terms, in the stated order, against mac_dot.


def spread(*shape, seed) -> torch.Tensor:
    """Values of different magnitudes on the float16 grid, whose float16 sums round."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-4, 3, shape, generator=g))
    return x.to(torch.float16).float()


def reference_product(a: torch.Tensor, b: torch.Tensor, mac: MAC) -> torch.Tensor:
    """a (M, K) @ b (K, N), each entry the exact reference's sum of a[i, k] b[k, j] for
    k = 0, ..., K - 1 under mac (float32 products are exact in float64)."""
    a64, b64 = a.double().tolist(), b.double().tolist()
    return torch.tensor(
        [
            [
                ref.mac_dot([a64[i][k] * b64[k][j] for k in range(len(b64))], mac)
                for j in range(len(b64[0]))
            ]
            for i in range(len(a64))
        ],
        dtype=torch.float32,
    )


def batched_reference(a: torch.Tensor, b: torch.Tensor, mac: MAC) -> torch.Tensor:
    return torch.stack([reference_product(a[i], b[i], mac) for i in range(a.shape[0])])


def rows(t: torch.Tensor) -> torch.Tensor:
    """(L, N, E) as (L N, E): rows (position, sequence), position-major."""
    return t.reshape(-1, t.shape[-1])


def heads(t: torch.Tensor, batch: int, num_heads: int) -> torch.Tensor:
    """(S, N, E) as (N H, S, E / H): matrix n H + h is head h of sequence n."""
    return t.reshape(t.shape[0], batch * num_heads, -1).transpose(0, 1)


class Reference:
    """The docstring's recipe, product by product, with torch for the scale, the masks and the
    softmax; ``forward`` keeps what ``backward`` needs."""

    def __init__(self, num_heads, macs, out_macs):
        self.num_heads, self.macs, self.out_macs = num_heads, macs, out_macs

    def forward(self, query, key, value, w_q, w_k, w_v, w_out, bias_kv=None, zero=False, mask=None):
        mac = self.macs[0]
        tgt, batch, embed = query.shape
        q = reference_product(rows(query), w_q.t(), mac).reshape(tgt, batch, embed)
        k = reference_product(rows(key), w_k.t(), mac).reshape(key.shape[0], batch, embed)
        v = reference_product(rows(value), w_v.t(), mac).reshape(key.shape[0], batch, embed)
        if bias_kv is not None:
            k = torch.cat([k, bias_kv[0].repeat(1, batch, 1)])
            v = torch.cat([v, bias_kv[1].repeat(1, batch, 1)])
        qh, kh, vh = (heads(t, batch, self.num_heads) for t in (q, k, v))
        if zero:
            kh = torch.cat([kh, kh.new_zeros(kh.shape[0], 1, kh.shape[2])], dim=1)
            vh = torch.cat([vh, vh.new_zeros(vh.shape[0], 1, vh.shape[2])], dim=1)
        scaled = qh * math.sqrt(1.0 / qh.shape[-1])
        scores = batched_reference(scaled, kh.transpose(1, 2), mac)
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1)
        context = batched_reference(weights, vh, mac)
        context_rows = context.transpose(0, 1).reshape(tgt * batch, embed)
        out = reference_product(context_rows, w_out.t(), self.out_macs[0])
        self.saved = (query, w_q, w_k, w_v, w_out, kh, vh, scaled, scores, weights, context_rows)
        return out.reshape(tgt, batch, embed), weights

    def backward(self, grad_out):
        """The gradients of a self-attention's input, packed in_proj_weight and out_proj.weight
        (query is key is value: one product by the packed weight, as torch groups it)."""
        x, w_q, w_k, w_v, w_out, kh, vh, scaled, scores, weights, context_rows = self.saved
        _, input_grad, weight_grad = self.macs
        tgt, batch, embed = x.shape
        g_rows = rows(grad_out)
        grad_w_out = reference_product(g_rows.t(), context_rows, self.out_macs[2])
        g_context = reference_product(g_rows, w_out, self.out_macs[1])
        g_context = heads(g_context.reshape(tgt, batch, embed), batch, self.num_heads)
        g_weights = batched_reference(g_context, vh.transpose(1, 2), input_grad)  # K = head_dim
        g_v = batched_reference(weights.transpose(1, 2), g_context, weight_grad)  # K = L
        s = scores.clone().requires_grad_()
        F.softmax(s, dim=-1).backward(g_weights)  # torch's softmax backward on the same values
        g_scaled = batched_reference(s.grad, kh, input_grad)  # K = S
        g_k = batched_reference(scaled.transpose(1, 2), s.grad, weight_grad).transpose(1, 2)
        g_q = g_scaled * math.sqrt(1.0 / kh.shape[-1])
        back = lambda t: t.transpose(0, 1).reshape(tgt * batch, embed)  # noqa: E731
        g_qkv = torch.cat([back(g_q), back(g_k), back(g_v)], dim=1)  # (L N, 3 E)
        packed = torch.cat([w_q, w_k, w_v])
        grad_x = reference_product(g_qkv, packed, input_grad).reshape(tgt, batch, embed)
        grad_w = reference_product(g_qkv.t(), rows(x), weight_grad)  # K = L N
        return grad_x, grad_w, grad_w_out


def test_self_attention_sums_each_product_in_the_stated_order_forward_and_backward():
    embed, num_heads, tgt, batch = 4, 2, 3, 2  # head_dim 2: the scale 1/sqrt(2) rounds
    x = spread(tgt, batch, embed, seed=1).requires_grad_()
    w_in = spread(3 * embed, embed, seed=2).requires_grad_()
    w_out = spread(embed, embed, seed=3).requires_grad_()
    mask = spread(tgt, tgt, seed=4)
    macs, out_macs = (FLOAT16, FLOAT16_PAIRWISE, BFLOAT16), (E6M8, E6M8_CHUNKED, E8M5)
    out, weights = LF.multi_head_attention_forward(
        *(x, x, x, embed, num_heads, w_in, None, None, None, False, 0.0, w_out, None),
        attn_mask=mask,
        average_attn_weights=False,
        mac=macs[0],
        input_grad_mac=macs[1],
        weight_grad_mac=macs[2],
        out_proj_macs=out_macs,
    )
    grad = spread(tgt, batch, embed, seed=5)
    out.backward(grad)
    reference = Reference(num_heads, macs, out_macs)
    w_q, w_k, w_v = w_in.detach().chunk(3)
    want, want_weights = reference.forward(
        x.detach(), x.detach(), x.detach(), w_q, w_k, w_v, w_out.detach(), mask=mask
    )
    assert_same_bits(out.detach(), want, "output")
    assert_same_bits(weights.detach(), want_weights.reshape(weights.shape), "weights")
    grad_x, grad_w, grad_w_out = reference.backward(grad)
    assert_same_bits(x.grad, grad_x, "gradient of the input")
    assert_same_bits(w_in.grad, grad_w, "gradient of in_proj_weight")
    assert_same_bits(w_out.grad, grad_w_out, "gradient of out_proj.weight")
    native = F.multi_head_attention_forward(
        *(x, x, x, embed, num_heads, w_in, None, None, None, False, 0.0, w_out, None),
        attn_mask=mask,
    )[0]
    assert not torch.equal(out, native)  # the MACs round: the comparison above can fail


def test_cross_attention_with_bias_kv_and_zero_attention_sums_in_the_stated_order():
    embed, num_heads, tgt, src, batch, kdim, vdim = 4, 2, 3, 2, 2, 3, 5
    query = spread(tgt, batch, embed, seed=10)
    key, value = spread(src, batch, kdim, seed=11), spread(src, batch, vdim, seed=12)
    w_q, w_k = spread(embed, embed, seed=13), spread(embed, kdim, seed=14)
    w_v = spread(embed, vdim, seed=15)
    w_out = spread(embed, embed, seed=16)
    bias_k, bias_v = spread(1, 1, embed, seed=17), spread(1, 1, embed, seed=18)
    padding = torch.tensor([[False, True], [False, False]])
    out, weights = LF.multi_head_attention_forward(
        *(query, key, value, embed, num_heads, None, None, bias_k, bias_v, True, 0.0, w_out),
        None,
        key_padding_mask=padding,
        use_separate_proj_weight=True,
        q_proj_weight=w_q,
        k_proj_weight=w_k,
        v_proj_weight=w_v,
        average_attn_weights=False,
        mac=FLOAT16,
    )
    # The padding mask, then bias_k's and add_zero_attn's positions unmasked, for every head.
    additive = torch.zeros(batch, src).masked_fill(padding, -math.inf)
    additive = F.pad(additive, (0, 2)).repeat_interleave(num_heads, 0).unsqueeze(1)
    reference = Reference(num_heads, (FLOAT16,) * 3, (FLOAT16,) * 3)
    want, want_weights = reference.forward(
        query, key, value, w_q, w_k, w_v, w_out, (bias_k, bias_v), True, additive
    )
    assert_same_bits(out, want, "output")
    assert_same_bits(weights, want_weights.reshape(weights.shape), "weights")
    assert weights[0, :, :, 1].eq(0).all()  # the padded position


def test_stochastic_macs_are_reproducible_under_manual_seed():
    x = spread(3, 2, 4, seed=20)
    w_in, w_out = spread(12, 4, seed=21), spread(4, 4, seed=22)
    args = (x, x, x, 4, 2, w_in, None, None, None, False, 0.0, w_out, None)
    torch.manual_seed(5)
    first = LF.multi_head_attention_forward(*args, mac=BFLOAT16_SR)[0]
    torch.manual_seed(5)
    assert_same_bits(LF.multi_head_attention_forward(*args, mac=BFLOAT16_SR)[0], first)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(is_causal=True), ValueError, "is_causal"),
        (dict(attn_mask=torch.zeros(2, 2)), ValueError, "attn_mask"),
        (dict(key_padding_mask=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "key_padding"),
        (dict(out_proj_macs=FLOAT16), TypeError, "out_proj_macs"),
        (dict(mac="fp16"), TypeError, "mac"),
        (dict(embed_dim_to_check=5), ValueError, "embed_dim_to_check"),
        # A ZeroDivisionError, a reshape's error: neither named num_heads.
        (dict(num_heads=0), ValueError, "num_heads must be an int >= 1"),
        (dict(num_heads=-2), ValueError, "num_heads must be an int >= 1"),
        # torch's explicit path skips dropout for these, silently.
        (dict(dropout_p=-0.5), ValueError, r"dropout_p must be in \[0, 1\]"),
        (dict(dropout_p=float("nan")), ValueError, r"dropout_p must be in \[0, 1\]"),
    ],
)
def test_bad_arguments_raise_errors_that_name_them(change, error, words):
    x = spread(3, 2, 4, seed=23)
    arguments = dict(
        query=x,
        key=x,
        value=x,
        embed_dim_to_check=4,
        num_heads=2,
        in_proj_weight=spread(12, 4, seed=24),
        in_proj_bias=None,
        bias_k=None,
        bias_v=None,
        add_zero_attn=False,
        dropout_p=0.0,
        out_proj_weight=spread(4, 4, seed=25),
        out_proj_bias=None,
    )
    with pytest.raises(error, match=words):
        LF.multi_head_attention_forward(**{**arguments, **change})


def test_a_non_native_mac_refuses_float64():
    module = make_module({})
    x = torch.randn(3, 2, EMBED, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        simulated(module, FLOAT16)(x, x, x)


# ---- inject: a model's attention under MACs.


def encoder(batch_first=False, layers=1) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=batch_first)


MACS_EVERYWHERE = {(nn.MultiheadAttention, nn.Linear): LayerQuantization(mac=FLOAT16)}


def test_an_injected_encoder_simulates_attention_without_warnings_and_remove_restores_it():
    model = encoder()
    x = spread(5, 2, 8, seed=30)
    before = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpsim.nn.inject(model, MACS_EVERYWHERE)
    simulated_names = [name for name, _, done in lpsim.nn.injected(model) if "macs" in done]
    assert simulated_names == [
        "layers.0.self_attn",
        "layers.0.self_attn.out_proj",
        "layers.0.linear1",
        "layers.0.linear2",
    ]
    y = model(x)
    assert not torch.equal(y, before)
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    lpsim.nn.remove(model)
    assert "forward" not in vars(model.layers[0].self_attn)
    assert not model.layers[0]._forward_pre_hooks
    assert_same_bits(model(x), before)


def test_an_injected_attention_computes_the_functional_op():
    model = encoder()
    lpsim.nn.inject(model, {nn.MultiheadAttention: LayerQuantization(mac=FLOAT16)})
    attention = model.layers[0].self_attn
    x = spread(5, 2, 8, seed=31)
    want = LF.multi_head_attention_forward(
        *(x, x, x, 8, 2, attention.in_proj_weight, attention.in_proj_bias, None, None, False),
        0.0,
        attention.out_proj.weight,
        attention.out_proj.bias,
        need_weights=False,
        mac=FLOAT16,
    )[0]
    assert_same_bits(attention(x, x, x, need_weights=False)[0], want)


def test_default_entry_leaves_attention_unsimulated_and_says_out_proj_macs_never_run():
    model = encoder()
    with pytest.warns(UserWarning, match="never run") as caught:
        lpsim.nn.inject(model, {"default": LayerQuantization(mac=FLOAT16)})
    message = str(caught[0].message)
    assert "'layers.0.self_attn.out_proj'" in message
    assert "MACs (MultiheadAttention has none" in message
    assert "input/output/error" not in message


def test_out_proj_quantisers_still_never_run_and_report_says_so():
    model = encoder()
    with pytest.warns(UserWarning, match="never run") as caught:
        lpsim.nn.inject(
            model,
            {
                nn.MultiheadAttention: LayerQuantization(mac=FLOAT16),
                nn.Linear: LayerQuantization(output=(Float(5, 2), "nearest"), mac=BFLOAT16),
            },
        )
    message = str(caught[0].message)
    assert "'layers.0.self_attn.out_proj'" in message and "input/output/error" in message
    assert "MACs" not in message.split("never run:")[1]  # the attention runs out_proj's MACs
    with pytest.warns(UserWarning, match="input/output/error never run"):
        table = lpsim.nn.report(model)
    row = next(line for line in table.splitlines() if line.startswith("layers.0.self_attn "))
    assert "MultiheadAttention" in row and str(FLOAT16) in row


def attention_with(config) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(8, 2)
    lpsim.nn.inject(module, config, unmatched="ignore")
    return module


def functional_attention(module, x, **macs):
    return LF.multi_head_attention_forward(
        *(x, x, x, 8, 2, module.in_proj_weight, module.in_proj_bias, None, None, False, 0.0),
        module.out_proj.weight,
        module.out_proj.bias,
        **macs,
    )[0]


def test_out_proj_uses_its_own_macs_when_injected_with_macs_else_the_attentions():
    x = spread(5, 2, 8, seed=32)
    own = (BFLOAT16, BFLOAT16, BFLOAT16)
    both = attention_with(
        {"": LayerQuantization(mac=FLOAT16), "out_proj": LayerQuantization(mac=BFLOAT16)}
    )
    assert_same_bits(
        both(x, x, x)[0], functional_attention(both, x, mac=FLOAT16, out_proj_macs=own)
    )
    alone = attention_with({"": LayerQuantization(mac=FLOAT16)})
    assert_same_bits(alone(x, x, x)[0], functional_attention(alone, x, mac=FLOAT16))
    e5m2 = (Float(5, 2), "nearest")
    weight_only = attention_with(
        {"": LayerQuantization(mac=FLOAT16), "out_proj": LayerQuantization(weight=e5m2)}
    )
    assert_same_bits(weight_only(x, x, x)[0], functional_attention(weight_only, x, mac=FLOAT16))
    assert not torch.equal(both(x, x, x)[0], alone(x, x, x)[0])  # the MACs tell apart


def test_eval_mode_uses_the_eval_macs_of_attention_and_out_proj():
    x = spread(5, 2, 8, seed=33)
    module = attention_with(
        {"": LayerQuantization(mac=BFLOAT16_SR), "out_proj": LayerQuantization(mac=BFLOAT16_SR)}
    ).eval()
    with torch.no_grad():
        got = module(x, x, x)[0]
        want = functional_attention(module, x, mac=BFLOAT16, out_proj_macs=(BFLOAT16,) * 3)
    assert_same_bits(got, want)


# ---- torch's fused transformer paths: eval without gradients computes as with gradients.

PADDING = torch.tensor([[False] * 5, [False, False, False, True, True]])


@pytest.mark.parametrize("padding", [None, PADDING], ids=["no mask", "key padding mask"])
@pytest.mark.parametrize(
    "config",
    [
        MACS_EVERYWHERE,
        {
            nn.MultiheadAttention: LayerQuantization(mac=FLOAT16, input=(Float(5, 2), "nearest")),
            nn.Linear: LayerQuantization(mac=BFLOAT16, output=(Float(5, 2), "nearest")),
        },
    ],
    ids=["macs", "macs and quantisers"],
)
@pytest.mark.filterwarnings("ignore:inject\\(\\)")  # out_proj's output quantiser never runs
def test_injected_encoder_in_eval_without_grad_computes_as_with_grad(config, padding):
    model = encoder(batch_first=True, layers=2).eval()
    lpsim.nn.inject(model, config, unmatched="ignore")
    x = spread(2, 5, 8, seed=34)
    with_grad = model(x, src_key_padding_mask=padding)
    with torch.no_grad():  # torch's fused layer and nested tensors, were they not kept off
        assert_same_bits(model(x, src_key_padding_mask=padding), with_grad.detach())


@pytest.mark.filterwarnings("ignore:inject\\(\\)")  # out_proj's input quantiser never runs
def test_input_quantisers_see_padded_tensors_in_eval_without_grad():
    model = encoder(batch_first=True, layers=2).eval()
    lpsim.nn.inject(model, {nn.Linear: LayerQuantization(input=(Float(8, 7), "nearest"))})
    x = spread(2, 5, 8, seed=35)
    with_grad = model(x, src_key_padding_mask=PADDING).detach()
    with torch.no_grad():  # a nested tensor would reach the quantisers, which take none
        without = model(x, src_key_padding_mask=PADDING)
    # torch's own MultiheadAttention takes its fused path without gradients: rounding apart.
    torch.testing.assert_close(without, with_grad, rtol=1e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own
def test_remove_gives_torch_its_fast_paths_back():
    model = encoder(batch_first=True, layers=2).eval()
    x = spread(2, 5, 8, seed=36)
    with torch.no_grad():
        before = model(x, src_key_padding_mask=PADDING)
    lpsim.nn.inject(model, MACS_EVERYWHERE)
    assert not model.use_nested_tensor and model.layers[1]._forward_pre_hooks
    lpsim.nn.remove(model)
    assert model.use_nested_tensor and not model.layers[1]._forward_pre_hooks
    with torch.no_grad():
        assert_same_bits(model(x, src_key_padding_mask=PADDING), before)


def test_a_float32_mask_on_bfloat16_attention_is_added_in_the_scores_dtype_as_torch_adds_it():
    """torch's attention (need_weights=False, its scaled_dot_product_attention) takes a bfloat16
    MultiheadAttention with a float32 mask, such as nn.Transformer.generate_square_subsequent_mask
    gives: the mask is added to the bfloat16 scores in place, rounded once to bfloat16. The
    simulated module does the same (it raised a dtype error), bit for bit the documented steps
    written by hand, and to bfloat16 rounding torch's result."""
    torch.manual_seed(40)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).bfloat16()
    simulated = copy.deepcopy(attention)
    lpsim.nn.inject(simulated, {nn.MultiheadAttention: LayerQuantization(mac=NATIVE)})
    x = torch.randn(2, 5, 8).bfloat16()
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert mask.dtype == torch.float32
    got = simulated(x, x, x, attn_mask=mask, need_weights=False)[0]
    # The steps of multi_head_attention_forward's docstring, in bfloat16.
    q, k, v = F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, dim=-1)
    heads = lambda t: t.reshape(2, 5, 2, 4).transpose(1, 2).reshape(4, 5, 4)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    scores = torch.bmm(q * math.sqrt(1 / 4), k.transpose(1, 2)).add_(mask)
    context = torch.bmm(torch.softmax(scores, dim=-1), v)
    context = context.reshape(2, 2, 5, 4).transpose(1, 2).reshape(2, 5, 8)
    expected = F.linear(context, attention.out_proj.weight, attention.out_proj.bias)
    assert got.dtype == torch.bfloat16
    assert_same_bits(got, expected)
    torch_result = attention(x, x, x, attn_mask=mask, need_weights=False)[0]
    torch.testing.assert_close(got.float(), torch_result.float(), atol=0.05, rtol=0.05)

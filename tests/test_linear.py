"""FP4Linear: the three GEMMs quantized exactly as each preset's table says."""
import dataclasses
from unittest import mock

import pytest
import torch
from torch import nn

import hf_fp4
from hf_fp4 import FP4Linear, QuantSpec, apply_hadamard, fake_quantize, observe_operands, preset, seeded_signs
from hf_fp4.numerics.quantize import quantize
from hf_fp4.nn.recipe import LinearRecipe
from exactness import assert_within_accumulation_error
from thresholds import LINEAR_SQNR_MIN_DB, LORA_SVD_MIN_IMPROVEMENT

T, K, N = 64, 96, 80  # tokens, in-features, out-features (multiples of 16, not of 32 for N: padding)

# The presets written out by hand: per GEMM, (lhs preset, lhs rounding, rhs preset, Hadamard kind, size).
EXPECTED = {
    "nvfp4": {"fprop": ("nvfp4", "nearest", "nvfp4_2d", "none", 16),
              "dgrad": ("nvfp4", "stochastic", "nvfp4_2d", "none", 16),
              "wgrad": ("nvfp4", "stochastic", "nvfp4", "random_fixed", 16)},
    "mxfp4": {g: ("mxfp4", "nearest", "mxfp4", "none", 16) for g in ("fprop", "dgrad", "wgrad")},
    "mxfp4_dh": {"fprop": ("mxfp4", "nearest", "mxfp4", "none", 16),
                 "dgrad": ("mxfp4", "nearest", "mxfp4", "none", 16),
                 "wgrad": ("mxfp4", "nearest", "mxfp4", "deterministic", 32)},
    "ufp4": {"fprop": ("ufp4", "nearest", "ufp4", "random_fixed", 16),
             "dgrad": ("ufp4", "stochastic", "ufp4", "random_fixed", 16),
             "wgrad": ("ufp4", "stochastic", "ufp4", "random_fixed", 16)},
    "tib": {"fprop": ("mxfp4_2d_up", "nearest", "mxfp4_2d_up", "none", 16),
            "dgrad": ("mxfp4_2d_up", "stochastic", "mxfp4_2d_up", "none", 16),
            "wgrad": ("mxfp4_2d_up", "stochastic", "mxfp4_2d_up", "none", 16)},
}


def make_layer(name, seed=0, bias=False):
    torch.manual_seed(seed)
    base = nn.Linear(K, N, bias=bias)
    recipe = preset(name, seed=seed)
    return base, FP4Linear.from_linear(nn.Linear(K, N, bias=bias).requires_grad_(), recipe.linear,
                                       name="layer", seed=seed)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=g), torch.randn(T, N, generator=g)


def run(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


def test_bf16_recipe_equals_nn_linear_exactly():
    torch.manual_seed(0)
    ref = nn.Linear(K, N)
    layer = FP4Linear.from_linear(nn.Linear(K, N), preset("bf16").linear)
    layer.load_state_dict(ref.state_dict())
    x, dy = inputs()
    x3 = x.reshape(4, 16, K)
    for a, b in zip(run(ref, x3, dy.reshape(4, 16, N)), run(layer, x3, dy.reshape(4, 16, N))):
        assert torch.equal(a, b)
    assert torch.equal(ref.bias.grad, layer.bias.grad)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_a_batch_of_sequences_trains_as_its_flattened_tokens(name):
    """x [B, S, K] (read by the kernels through its strides) gives the y, dx and dW of x [B*S, K]."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels in Triton's interpreter
    _, layer = make_layer(name, seed=4)
    layer = layer.to(dev)
    layer.backend = "triton"
    x, dy = (t.to(dev) for t in inputs())
    flat = run(layer, x, dy)
    layer.sr_calls = 0
    layer.zero_grad()
    batched = run(layer, x.reshape(4, T // 4, K), dy.reshape(4, T // 4, N))
    for a, b in zip(flat, batched):
        assert torch.equal(a.reshape(b.shape), b) or torch.equal(a, b.reshape(a.shape))


def test_under_autocast_the_gradients_are_nn_linears():
    """FP32 master weight and input under bf16 autocast: y, dx and dW in the dtypes and values nn.Linear gives
    (GEMM outputs in BF16, then the input's / weight's dtype)."""
    torch.manual_seed(0)
    ref = nn.Linear(K, N)
    layer = FP4Linear.from_linear(nn.Linear(K, N), preset("bf16").linear)
    layer.load_state_dict(ref.state_dict())
    x, dy = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = run(ref, x, dy.bfloat16()), run(layer, x, dy.bfloat16())
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[1].dtype == got[2].dtype == torch.float32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, fp4 = make_layer("mxfp4")  # quantized GEMMs too: outputs rounded to BF16 once, then widened
    fp4 = fp4.to(dev)
    fp4.backend = "triton"
    xg = x.to(dev).requires_grad_()
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = fp4(xg)
    y.backward(dy.to(dev, torch.bfloat16))  # outside autocast, as a training loop does (and as CUDA's backward thread runs)
    dx, dw = xg.grad, fp4.weight.grad
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == torch.float32
    for g in (dx, dw):
        assert torch.equal(g, g.bfloat16().float())
    seen = {}  # and x is quantized from its BF16 value, as nn.Linear and TransformerEngine cast it
    with observe_operands(lambda m, g, r, op, q, spec: seen.setdefault((g, r), (op, q, spec))):
        with torch.autocast(dev, dtype=torch.bfloat16):
            fp4(x.to(dev))
    op, q, spec = seen[("fprop", "lhs")]
    assert torch.equal(op, x.to(dev).bfloat16().float())
    assert torch.equal(q, fake_quantize(x.to(dev).bfloat16().float(), spec))


@pytest.mark.parametrize("name,backend", [("nvfp4", "reference"), ("ufp4", "reference"), ("mxfp4", "reference"),
                                          ("nvfp4", "triton"), ("ufp4", "triton")])
def test_under_autocast_a_layer_computes_what_it_does_on_the_cast_input(name, backend):
    """Under BF16 autocast, y, dx and dW equal the same layer's (a fresh copy: the same SR step) on x cast to BF16
    outside autocast, bit for bit: autocast changes what enters the GEMMs (x in BF16, as nn.Linear), never how they
    compute -- its BF16 matmul rounded the reference's FP32 operands of the two-level formats (NVFP4 / UFP4 outputs
    one ulp off, session 35).  The Triton backend in the interpreter on the CPU."""
    import copy

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    _, layer = make_layer(name, seed=4)
    layer = layer.to(dev)
    layer.backend = backend
    twin = copy.deepcopy(layer)
    x, dy = (t.to(dev) for t in inputs(5))
    xa, xb = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
    with torch.autocast(dev, dtype=torch.bfloat16):
        ya = layer(xa)
    yb = twin(xb)
    ya.backward(dy.bfloat16())
    yb.backward(dy.bfloat16())
    assert ya.dtype == yb.dtype == torch.bfloat16 and torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad.float()) and torch.equal(layer.weight.grad, twin.weight.grad)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_operand_is_quantized_as_the_table_says(name):
    _, layer = make_layer(name, seed=3)
    x, dy = inputs()
    raw = {("fprop", "lhs"): x, ("fprop", "rhs"): layer.weight.detach(),
           ("dgrad", "lhs"): dy, ("dgrad", "rhs"): layer.weight.detach().t(),
           ("wgrad", "lhs"): dy.t(), ("wgrad", "rhs"): x.t()}
    seen = {}
    with observe_operands(lambda m, g, r, a, q, s: seen.__setitem__((g, r), (a, q, s))):
        run(layer, x, dy)
    assert set(seen) == set(raw)
    for (gemm, role), (operand, q, spec) in seen.items():
        lhs_name, lhs_rounding, rhs_name, h_kind, h_size = EXPECTED[name][gemm]
        expected_spec = dataclasses.replace(QuantSpec.preset(lhs_name if role == "lhs" else rhs_name),
                                            rounding=lhs_rounding if role == "lhs" else "nearest")
        assert spec == expected_spec, (gemm, role)
        expected = raw[(gemm, role)].float()
        if h_kind != "none":
            signs = seeded_signs(h_size, 3) if h_kind == "random_fixed" else None
            expected = apply_hadamard(expected, h_size, signs)
        assert torch.equal(operand, expected), (gemm, role)
        if spec.rounding.value == "nearest":
            assert torch.equal(q, fake_quantize(expected, spec)), (gemm, role)
        else:  # SR: on the grid of the same scales, not the RTN result, different per call
            rtn = fake_quantize(expected, dataclasses.replace(spec, rounding="nearest"))
            assert not torch.equal(q, rtn)
            # SR lands on one of the two neighbouring grid values: within the grid's largest gap times the
            # element's own decode factor (block scale x tensor scale)
            qt = quantize(expected, spec)
            decode = qt.block_decode().repeat_interleave(spec.block[0], 0).repeat_interleave(spec.block[1], 1)
            decode = decode[: expected.shape[0], : expected.shape[1]] * (qt.tensor_scale if qt.tensor_scale is not None
                                                                          else 1.0)
            gap = {"e2m1": 2.0, "e1m2": 0.25, "int4": 1.0}[spec.grid.value]
            assert ((q - expected).abs() <= gap * decode * (1 + 1e-6)).all(), (gemm, role)


@pytest.mark.parametrize("name", ["nvfp4", "tib"])
def test_2d_weight_used_by_dgrad_is_the_transpose_of_fprops(name):
    _, layer = make_layer(name)
    seen = {}
    with observe_operands(lambda m, g, r, a, q, s: seen.__setitem__((g, r), q)):
        run(layer, *inputs())
    assert torch.equal(seen[("dgrad", "rhs")], seen[("fprop", "rhs")].t())


def sqnr_db(ref, test):
    return float(20 * torch.log10(ref.norm() / (ref - test).norm()))


@pytest.mark.parametrize("name", sorted(LINEAR_SQNR_MIN_DB))
def test_gemm_sqnr_against_bf16(name):
    ref, layer = make_layer(name)
    layer.weight.data.copy_(ref.weight.data)
    x, dy = inputs()
    y0, dx0, dw0 = run(ref, x, dy)
    y1, dx1, dw1 = run(layer, x, dy)
    got = {"fprop": sqnr_db(y0, y1), "dgrad": sqnr_db(dx0, dx1), "wgrad": sqnr_db(dw0, dw1)}
    for gemm, threshold in LINEAR_SQNR_MIN_DB[name].items():
        assert got[gemm] > threshold, (gemm, got)


def test_quantization_changes_results():
    ref, layer = make_layer("mxfp4")
    layer.weight.data.copy_(ref.weight.data)
    x, dy = inputs()
    assert not torch.equal(run(ref, x, dy)[0], run(layer, x, dy)[0])


def test_gemm_switches_keep_unselected_gemms_in_high_precision():
    recipe = preset("mxfp4", gemms=("fprop",)).linear
    layer = FP4Linear.from_linear(nn.Linear(K, N, bias=False), recipe)
    ref = nn.Linear(K, N, bias=False)
    ref.weight.data.copy_(layer.weight.data)
    seen = []
    x, dy = inputs()
    with observe_operands(lambda m, g, r, a, q, s: seen.append(g)):
        _, dx1, dw1 = run(layer, x, dy)
    _, dx0, dw0 = run(ref, x, dy)
    assert set(seen) == {"fprop"}
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)


def test_stochastic_rounding_is_reproducible_from_the_seed():
    x, dy = inputs()
    grads = []
    for _ in range(2):
        _, layer = make_layer("nvfp4", seed=5)
        grads.append(run(layer, x, dy)[2])
    _, layer = make_layer("nvfp4", seed=6)
    layer.weight.data.copy_(make_layer("nvfp4", seed=5)[1].weight.data)
    other = run(layer, x, dy)[2]
    assert torch.equal(grads[0], grads[1])
    assert not torch.equal(grads[0], other)


def test_mean_bias_removal_is_exact_in_high_precision_and_helps_biased_activations():
    torch.manual_seed(0)
    ref = nn.Linear(K, N, bias=False)
    x, dy = inputs()
    x = x + 8.0 * torch.linspace(-1, 1, K)  # a coherent per-feature offset
    results = {}
    for mbr in (False, True):
        recipe = preset("mxfp4", mean_bias_removal=mbr).linear
        layer = FP4Linear.from_linear(nn.Linear(K, N, bias=False), recipe)
        layer.weight.data.copy_(ref.weight.data)
        results[mbr] = run(layer, x, dy)
    y0, _, dw0 = run(ref, x, dy)
    assert sqnr_db(y0, results[True][0]) > sqnr_db(y0, results[False][0]) + 1.0
    assert sqnr_db(dw0, results[True][2]) > sqnr_db(dw0, results[False][2])
    # with quantization off the rank-one correction is exact
    layer = FP4Linear.from_linear(nn.Linear(K, N, bias=False), preset("bf16", mean_bias_removal=True).linear)
    layer.weight.data.copy_(ref.weight.data)
    y, _, dw = run(layer, x, dy)
    assert torch.allclose(y, y0, atol=1e-4) and torch.allclose(dw, dw0, atol=1e-3)


def test_lora_svd_reduces_weight_error_and_trains_its_factors():
    torch.manual_seed(0)
    w = torch.randn(N, K) + 3 * torch.randn(N, 4) @ torch.randn(4, K)  # a few strong directions
    spec = QuantSpec.preset("nvfp4_2d")
    recipe = preset("nvfp4", lora_svd_rank=8).linear
    layer = FP4Linear.from_linear(nn.Linear(K, N, bias=False), recipe)
    layer.weight.data.copy_(w)
    layer.lora_svd_split(fresh=True)
    assert torch.allclose(layer.merged_weight().detach(), w, atol=1e-4)
    err_split = (w - (fake_quantize(layer.weight.detach(), spec) + layer.lora_svd_B @ layer.lora_svd_A)).norm()
    err_plain = (w - fake_quantize(w, spec)).norm()
    assert err_plain / err_split > LORA_SVD_MIN_IMPROVEMENT
    a0, b0 = layer.lora_svd_A.detach().clone(), layer.lora_svd_B.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    run(layer, *inputs())
    opt.step()
    assert not torch.equal(a0, layer.lora_svd_A) and not torch.equal(b0, layer.lora_svd_B)
    merged = layer.merged_weight().detach().clone()
    layer.lora_svd_split()  # periodic re-split keeps the represented weight
    assert torch.allclose(layer.merged_weight().detach(), merged, atol=1e-4)


def test_frozen_lora_svd_factors_take_no_update_and_the_weight_learns_as_without_them():
    """lora_svd_factors="frozen": A and B get no gradient and no optimizer update; W_res's gradient is the one
    a rank-0 layer of the same name and seed gets from the same x and dy (FP4 wgrad reads only x and dy); dx
    is that layer's (weight W_res) plus dy B A; a re-split keeps W_res + B A."""
    from hf_fp4.optim import build_optimizer, param_groups

    torch.manual_seed(0)
    w = torch.randn(N, K) + 3 * torch.randn(N, 4) @ torch.randn(4, K)
    frozen = FP4Linear.from_linear(nn.Linear(K, N, bias=False), preset(
        "nvfp4", lora_svd_rank=8, lora_svd_refresh_every=2, lora_svd_factors="frozen").linear, name="layer")
    frozen.weight.data.copy_(w)
    frozen.lora_svd_split(fresh=True)
    plain = FP4Linear.from_linear(nn.Linear(K, N, bias=False), preset("nvfp4").linear, name="layer")
    plain.weight.data.copy_(frozen.weight.data)
    x, dy = inputs()
    _, dx_frozen, dw_frozen = run(frozen, x, dy)
    _, dx_plain, dw_plain = run(plain, x, dy)
    assert frozen.lora_svd_A.grad is None and frozen.lora_svd_B.grad is None
    torch.testing.assert_close(dw_frozen, dw_plain, rtol=0, atol=0)
    low_rank = (dy @ frozen.lora_svd_B.detach()) @ frozen.lora_svd_A.detach()  # autograd's order: (dy B) A
    torch.testing.assert_close(dx_frozen, dx_plain + low_rank, rtol=0, atol=0)
    a0, b0, w0 = (t.detach().clone() for t in (frozen.lora_svd_A, frozen.lora_svd_B, frozen.weight))
    opt = build_optimizer("adamw", param_groups(frozen, "adamw", 0.1), 1e-2, (0.9, 0.95), {})
    opt.step()
    assert torch.equal(a0, frozen.lora_svd_A) and torch.equal(b0, frozen.lora_svd_B)
    assert not torch.equal(w0, frozen.weight)
    merged = frozen.merged_weight().detach().clone()
    frozen.lora_svd_split()
    assert torch.allclose(frozen.merged_weight().detach(), merged, atol=1e-4)
    assert not torch.equal(a0, frozen.lora_svd_A)  # the re-split moved the new top directions into them
    with pytest.raises(ValueError, match="lora_svd_factors='bogus': valid values are trained, frozen"):
        preset("nvfp4", lora_svd_rank=8, lora_svd_factors="bogus")
    with pytest.raises(ValueError, match="set lora_svd_refresh_every > 0"):
        preset("nvfp4", lora_svd_rank=8, lora_svd_factors="frozen")


def test_diagnostics_report_every_operand_and_the_transpose_mismatch():
    _, layer = make_layer("ufp4")
    with hf_fp4.collect_diagnostics() as stats:
        run(layer, *inputs())
    for gemm in ("fprop", "dgrad", "wgrad"):
        for role in ("lhs", "rhs"):
            assert 10 < stats[f"layer/{gemm}/{role}/sqnr_db"] < 40
            assert 0.9 < stats[f"layer/{gemm}/{role}/gain"] < 1.1
    assert stats["layer/weight_transpose_mismatch"] > 0
    _, layer = make_layer("nvfp4")
    with hf_fp4.collect_diagnostics() as stats:
        run(layer, *inputs())
    assert "layer/weight_transpose_mismatch" not in stats  # 2D weights: nothing to mismatch


def quantized_operands(name, layer, x, dy, call=0):
    """Per GEMM, its two operands quantized here with the reference, from the hand-written table (EXPECTED),
    the layer's seeds and its Hadamard signs: independent of the operand layer."""
    w = layer.weight.detach().float()
    raw = {("fprop", "lhs"): x, ("fprop", "rhs"): w, ("dgrad", "lhs"): dy, ("dgrad", "rhs"): w.t(),
           ("wgrad", "lhs"): dy.t(), ("wgrad", "rhs"): x.t()}
    out = []
    for gemm in ("fprop", "dgrad", "wgrad"):
        lhs_name, lhs_rounding, rhs_name, h_kind, h_size = EXPECTED[name][gemm]
        ops = []
        for role, pname, rounding in (("lhs", lhs_name, lhs_rounding), ("rhs", rhs_name, "nearest")):
            t = raw[(gemm, role)].float()
            if h_kind != "none":
                t = apply_hadamard(t, h_size, seeded_signs(h_size, layer.seed) if h_kind == "random_fixed" else None)
            spec = dataclasses.replace(QuantSpec.preset(pname), rounding=rounding)
            ops.append(quantize(t, spec, seed=layer.sr_seed(gemm, role, call)).dequantize())
        out.append(ops)
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_gemm_equals_the_float64_product_of_its_quantized_operands(name, backend):
    check_products(name, backend, T)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fast_path_products_with_a_ragged_token_count(name):
    """50 tokens: the wgrad contraction is padded to the block (and FP8 GEMMs to 16) on the fast path."""
    pytest.importorskip("hf_fp4.kernels.operand")
    check_products(name, "triton", 50)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_dh", "tib"])
def test_mx_gemms_on_the_bf16_tensor_cores_equal_the_float64_products(name):
    """fp8_gemms=False: the MX family's three GEMMs take the BF16 form (E2M1 x 2^e exact in BF16, FP32
    accumulation, no lost blocks to correct) and still equal the float64 products of the spec's operands."""
    pytest.importorskip("hf_fp4.kernels.operand")
    _, layer = make_layer(name)
    assert layer._plans["triton"].forms == ("fp8", "fp8", "fp8")
    layer.fp8_gemms = False
    assert layer._plans["triton"].forms == ("bf16", "bf16", "bf16")
    assert layer._plans["reference"].forms == ("fp32", "fp32", "fp32")
    check_products(name, "triton", T, fp8_gemms=False)


def check_products(name, backend, tokens, fp8_gemms=True):
    """What the layer computes (y, dx, dW), against products of operands built from the spec: within FP32
    accumulation error, elementwise.  The triton backend runs the operand kernels (interpreted on CPU) and
    the exact FP8 / BF16 GEMMs; the planted blocks lie beyond E4M3's range (FP8 recipes recompute them)."""
    if backend == "triton":
        pytest.importorskip("hf_fp4.kernels.operand")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the triton backend runs on the GPU there
    _, layer = make_layer(name, seed=4)
    layer = layer.to(dev)
    layer.backend = backend
    layer.fp8_gemms = fp8_gemms
    with torch.no_grad():
        layer.weight[:, :32] *= 2.0**20  # W's rows: a block 20 binades above the rest (lost in FP8)
    x, dy = (t[:tokens].to(dev) for t in inputs(seed=5))
    x[3] *= 2.0**-22  # a token far below the rest: its own FP8 row reference
    x[5, :32] *= 2.0**-20  # a block far below its token's others, meeting W's large columns
    x[32:, 40] *= 2.0**-22  # one below its feature's others along the tokens (wgrad's x^T)
    for call, (xs, dys) in enumerate([(x, dy), tuple(t[:tokens].to(dev) for t in inputs(seed=6))]):
        layer.zero_grad()
        got = run(layer, xs, dys)
        for gemm, g, (a, b) in zip(("fprop", "dgrad", "wgrad"), got, quantized_operands(name, layer, xs, dys, call)):
            assert_within_accumulation_error(g, a, b, f"{name}/{backend}/{gemm}/call {call}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", sorted(EXPECTED) + ["bf16"])
def test_torch_compile_fullgraph_equals_eager_bit_for_bit(name, backend):
    """FP4Linear under torch.compile(fullgraph=True): no graph break, no recompilation across steps, and
    forward + backward bit-identical to eager (custom ops for operands and FP8 GEMMs)."""
    if backend == "triton":
        pytest.importorskip("hf_fp4.kernels.operand")
    import torch._dynamo

    torch._dynamo.reset()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, eager = make_layer(name, seed=2, bias=True)
    _, compiled = make_layer(name, seed=2, bias=True)
    eager, compiled = eager.to(dev), compiled.to(dev)
    compiled.load_state_dict(eager.state_dict())
    eager.backend = compiled.backend = backend
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            x, dy = (t.to(dev) for t in inputs(seed=10 + step))
            for a, b in zip(run(eager, x, dy), run(fn, x, dy)):
                assert torch.equal(a, b), (name, step)
            assert torch.equal(eager.bias.grad, compiled.bias.grad)
            eager.zero_grad(), compiled.zero_grad()
    assert eager.sr_calls == compiled.sr_calls == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the opaque-op path on the CPU (Triton's interpreter); on "
                    "CUDA the kernels are triton_ops, compared with eager in test_inductor_launching_the_kernels_*")
@pytest.mark.parametrize("x_sr", [False, True])
def test_compiled_layers_sharing_an_input_quantize_it_once_unless_it_is_rounded_stochastically(x_sr):
    """q/k/v (and gate/up) read the same x.  Rounded to nearest, its operands are the same for all of them, and
    under torch.compile they are made once (one operand call for x, one per weight and per dy); rounded
    stochastically each layer draws its own noise, so each makes its own.  Either way, eager == compiled."""
    import torch._dynamo

    from hf_fp4.nn import operands as operands_module

    d = preset("mxfp4").linear.to_dict()
    if x_sr:
        d["wgrad"]["rhs"]["rounding"] = "stochastic"
    recipe = LinearRecipe.from_dict(d)

    def layers():
        torch.manual_seed(0)
        return [FP4Linear.from_linear(nn.Linear(K, N, bias=False), recipe, name=f"proj{i}") for i in range(3)]

    def loss(fs, h):
        return sum((f(h) * (i + 1)).sum() for i, f in enumerate(fs))

    def step(fs, x, fn):
        x = x.clone().requires_grad_()
        fn(x * 2).backward()  # x * 2: one tensor read by all three layers
        return x.grad, *(f.weight.grad for f in fs)

    eager, compiled = layers(), layers()
    for f in eager + compiled:
        f.backend = "triton"
    torch._dynamo.reset()
    x = torch.randn(T, K)
    want = step(eager, x, lambda h: loss(eager, h))
    calls, impl = [], operands_module._operands_impl
    with mock.patch.object(operands_module, "_operands_impl", lambda *a: calls.append(a[-1]) or impl(*a)):
        got = step(compiled, x, torch.compile(lambda h: loss(compiled, h), backend="aot_eager"))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert len(calls) == (3 if x_sr else 1) + 3 + 3, calls


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4_dh", "ufp4", "tib"])
def test_the_fast_path_keeps_no_tensor_alive_between_calls(name):
    """As FP4 attention (test_attention): under CUDA-graph trees the first training call is a warm-up in the graphs'
    memory pool, so a tensor the fast path made then and kept (a per-device cache) would break the capture ("not
    tracked as outputs").  The first forward + backward of a BF16 layer on the kernels (Triton's interpreter here),
    package caches cleared, leaves no tensor alive beyond the layer's own state once its output and gradients go."""
    from tiny import clear_package_caches, live_tensors

    clear_package_caches()
    _, layer = make_layer(name, seed=2)
    layer = layer.to(torch.bfloat16)
    layer.backend = "triton"
    x, dy = (t.to(torch.bfloat16) for t in inputs(seed=3))
    x.requires_grad_()
    before = live_tensors()
    layer(x).backward(dy)
    x.grad = layer.weight.grad = None
    owned = {id(t) for t in layer.state_dict(keep_vars=True).values()} | {
        id(v) for value in vars(layer).values()
        for v in (value.values() if isinstance(value, dict) else [value]) if torch.is_tensor(v)}
    left = [(tuple(t.shape), t.dtype) for i, t in live_tensors().items() if i not in before and i not in owned]
    assert not left, left


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "ufp4", "mxfp4_dh"])
def test_inductor_launching_the_kernels_equals_eager(name):
    """On CUDA the operand and FP8-GEMM ops are triton_ops: inductor traces into them and launches their
    kernels from its generated code.  Forward and backward stay bit-identical to eager, step after step."""
    import torch._dynamo

    torch._dynamo.reset()
    _, eager = make_layer(name, seed=3)
    _, compiled = make_layer(name, seed=3)
    eager, compiled = eager.cuda(), compiled.cuda()
    compiled.load_state_dict(eager.state_dict())
    fn = torch.compile(compiled, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(2):
            x, dy = (t.cuda() for t in inputs(seed=20 + step))
            for a, b in zip(run(eager, x, dy), run(fn, x, dy)):
                assert torch.equal(a, b), (name, step)
            eager.zero_grad(), compiled.zero_grad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "ufp4", "tib"])
def test_under_cuda_graphs_the_layer_equals_eager(name):
    """hf_fp4.compile_model's CUDA-graph mode: the layer's kernels stay in opaque custom ops (cuda_graphs=True),
    the step is captured as a graph (no cudagraph skip: an SR counter or Hadamard signs that stopped the capture
    would show here), and every replay equals eager bit for bit, SR counter included."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager = make_layer(name, seed=4)
    _, graphed = make_layer(name, seed=4)
    eager, graphed = eager.cuda(), graphed.cuda()
    graphed.load_state_dict(eager.state_dict())
    graphed.cuda_graphs = True
    fn = torch.compile(graphed, mode="reduce-overhead")
    for step in range(4):  # warm-up, recording, then replays
        x, dy = (t.cuda() for t in inputs(seed=30 + step))
        torch.compiler.cudagraph_mark_step_begin()
        for a, b in zip(run(eager, x, dy), run(fn, x, dy)):
            assert torch.equal(a, b), (name, step)
        eager.zero_grad(), graphed.zero_grad()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert eager.sr_calls == graphed.sr_calls == 4


def test_an_input_on_another_device_than_the_weight_is_named_as_such():
    """As nn.Linear, a layer and an input on different devices are refused with both devices named -- not left to
    a Triton kernel that cannot read a pointer (the GPU suite met that message with a CPU layer and a CUDA input)."""
    _, layer = make_layer("nvfp4")
    x, _ = inputs()
    with pytest.raises(RuntimeError, match=r"FP4Linear layer: the input is on meta and the weight on cpu"):
        layer(x.to("meta"))
    assert layer(x).shape == (T, N)  # same device: unchanged

"""FP4 attention (hf_fp4.nn.attention): the reference against products built independently from the spec in
float64, SDPA when nothing is quantized, masks and GQA, and attn_implementation="hf_fp4" in a model."""
import dataclasses

import pytest
import torch
from tiny import cuda_train_steps, tiny_config

import hf_fp4
from hf_fp4 import QuantSpec, quantize
from hf_fp4.nn.attention import AttentionRecipe, fp4_attention

B, H, HKV, T, D = 2, 4, 2, 24, 32


def qkv(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, h, T, D, generator=g) * s).to(dtype).requires_grad_()
            for h, s in ((H, 1.0), (HKV, 1.0), (HKV, 2.0))]


def q64(x, spec, along_last=True):
    """x quantized by hf_fp4.numerics.quantize with blocks along the last dim (or dim -2), as float64."""
    y = x if along_last else x.transpose(-1, -2)
    out = quantize(y.float().reshape(-1, y.shape[-1]), spec).dequantize(torch.float32).reshape(y.shape).double()
    return out if along_last else out.transpose(-1, -2)


def expected(q, k, v, d_out, keep, spec: QuantSpec):
    """The spec in float64: O, dQ, dK, dV of quantized Q, K, V (blocks along head_dim), BF16 P, and dS
    quantized along keys for dQ and along queries for dK."""
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    qh, kh, vh = q64(q, spec), q64(k, spec), q64(v, spec)
    scale = D ** -0.5
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1)
    pb = p.to(torch.bfloat16).double()
    out = pb @ vh
    o_stored = out.to(torch.bfloat16).double()
    do = d_out.double()
    dv = pb.transpose(-1, -2) @ do
    ds = p * (do @ vh.transpose(-1, -2) - (do * o_stored).sum(-1, keepdim=True))
    dq = q64(ds, spec) @ kh * scale
    dk = q64(ds, spec, along_last=False).transpose(-1, -2) @ qh * scale
    fold = lambda t: t.reshape(B, HKV, H // HKV, T, D).sum(2)  # noqa: E731  (GQA: the group's gradients add)
    return out, dq, fold(dk), fold(dv), ds


def close(got, want, rel=2e-3):
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err:.3g} vs scale {want.abs().max().item():.3g}"


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_forward_and_backward_follow_the_spec(name):
    q, k, v = qkv(1)
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    d_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = fp4_attention(q, k, v, keep, recipe=name)
    out.backward(d_out)
    want_o, want_dq, want_dk, want_dv, ds = expected(q, k, v, d_out, keep, QuantSpec.preset(name))
    close(out, want_o, rel=1e-2)  # out is BF16
    close(q.grad, want_dq, rel=1e-2)
    close(k.grad, want_dk, rel=1e-2)
    close(v.grad, want_dv, rel=1e-2)
    # the check can fail: dQ from the unquantized dS is measurably different
    kh = q64(k.repeat_interleave(H // HKV, 1), QuantSpec.preset(name))
    with pytest.raises(AssertionError):
        close(q.grad, ds @ kh * D ** -0.5, rel=1e-2)


def test_with_nothing_quantized_it_is_sdpa():
    q, k, v = qkv(3, torch.float32)
    out = fp4_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril(), recipe="none")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    assert (out - ref).abs().max() < 2e-2 * ref.abs().max()  # P rounded to BF16 for P V
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, w in zip(grads, want):
        assert (g - w).abs().max() < 2e-2 * w.abs().max()


def test_padding_masks_gqa_and_a_fully_masked_row():
    q, k, v = qkv(4)
    keep = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    keep[1, :, :, :5] = False   # sample 1: the first five keys are padding
    keep[1, :, 3] = False       # ... and query 3 sees nothing: its output is 0, its gradients finite
    out = fp4_attention(q, k, v, keep, recipe="nvfp4")
    out.float().sum().backward()
    assert torch.all(out[1, :, 3] == 0) and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # a masked key changes nothing: perturbing sample 1's padded keys leaves its output as it was (MXFP4: per-
    # block scales along head_dim; NVFP4's tensor scale would see the padded keys' amax, as in TransformerEngine)
    ref = fp4_attention(q.detach(), k.detach(), v.detach(), keep, recipe="mxfp4")
    k2 = k.detach().clone()
    k2[1, :, :5] += 100
    same = fp4_attention(q.detach(), k2, v.detach(), keep, recipe="mxfp4")
    assert torch.equal(same[1], ref[1]) and not torch.equal(same[1, :, :, :], ref[0])


def padding_part(keep):
    """keep [..., T, T] (a causal mask with padding) with the causal part lifted: what a kernel given
    causal=True must be handed to mask the same entries."""
    t = keep.shape[-1]
    return keep | ~torch.ones(t, t, dtype=torch.bool).tril()


@pytest.mark.parametrize("padding", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "none"])
def test_the_flash_forward_kernel_is_the_spec_within_the_bf16_rounding_of_p(name, causal, padding):
    """hf_fp4.kernels.attention.flash_forward on the quantized Q^, K^, V^: within the spec's and the kernel's
    BF16 roundings of each P element plus FP32 accumulation of the float64 spec (causal + padding + a query that sees nothing, GQA
    expanded, ragged T over several key tiles); the unrounded P's product lies outside that bound.  causal: the
    kernel computes the causal part of the mask and skips the key tiles after each query block (16 x 32 tiles:
    a skip bound one tile short would drop keys, outside the bound).  Without a padding mask the kernel runs the
    tiles every row attends without masks (before the causal diagonal; every full tile without causal) and the
    rest masked: a bound one tile too far would attend keys after a query, one too short only costs time."""
    from hf_fp4.nn.attention import quantize_rows, tensor_core_operand
    from hf_fp4.kernels.attention import flash_forward

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    t = 70
    q, k, v = (torch.randn(B, H, t, D, generator=g) * s for s in (1.0, 1.0, 3.0))
    q[0, 0, 5] *= 30  # one sharp row: P near one-hot
    keep = torch.ones(B, 1, t, t, dtype=torch.bool)
    if causal or padding:
        keep = keep.tril()
    if padding:
        keep[1, :, :, :9] = False
        keep[1, :, 4] = False
    spec = None if name == "none" else QuantSpec.preset(name)
    qh, kh, vh = (quantize_rows(x, spec, 0) for x in (q, k, v))
    scale = D ** -0.5
    # causal: only the padding part travels as a mask; no padding: no mask at all
    kernel_keep, tile = (padding_part(keep), (16, 32)) if causal else (keep, None if padding else (16, 32))
    if not padding:
        kernel_keep = None

    def kernel(q_, k_, v_, decodes=None):
        keep_ = None if kernel_keep is None else kernel_keep.to(dev)
        return flash_forward(q_.to(dev), k_.to(dev), v_.to(dev), keep_, scale, decodes, tile,
                             causal=causal).cpu().double()

    outs = [kernel(qh, kh, vh)]
    if spec is not None:  # the tensor cores' operands: exact BF16 values and a tensor decode scale
        ops = [tensor_core_operand(x, spec, 0) for x in (q, k, v)]
        for (values, decode), want_values in zip(ops, (qh, kh, vh)):
            assert values.dtype == torch.bfloat16 and torch.equal(values.float() * decode, want_values)
        # the fused quantizer's operands (what backend="triton" feeds the kernels): the same, bit for bit
        for x, (values, decode) in zip((q, k, v), ops):
            fast_values, fast_decode = tensor_core_operand(x.to(dev), spec, 0, backend="triton")
            assert torch.equal(fast_values.cpu(), values) and torch.equal(fast_decode.cpu(), decode)
        decodes = torch.stack([o[1] for o in ops]).to(dev)
        outs.append(kernel(*(o[0] for o in ops), decodes))
    s64 = (qh.double() @ kh.double().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s64, -1), nan=0.0)
    mag = p @ vh.double().abs()
    # each side rounds P once to BF16 (<= 2^-8 relative), computes S in FP32 (|dS| <= D 2^-24 |q||k| scale, so
    # P moves by at most 2 max|dS| relative), and sums P V in FP32
    ds_max = (D * 2.0**-24 * scale * (qh.double().abs() @ kh.double().abs().transpose(-1, -2))).amax(-1, keepdim=True)
    bound = (2.0**-7 + 4 * ds_max + t * 2.0**-24) * mag + 1e-30
    want = p.to(torch.bfloat16).double() @ vh.double()
    unrounded = p @ vh.double()
    if spec is not None and not padding:  # O written in BF16 by the kernel: the FP32 O rounded to nearest
        got = flash_forward(*(o[0].to(dev) for o in ops), None, scale, decodes, tile, causal=causal,
                            out_dtype=torch.bfloat16)
        want_bf16 = flash_forward(*(o[0].to(dev) for o in ops), None, scale, decodes, tile, causal=causal)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want_bf16.to(torch.bfloat16))
    for out in outs:
        assert torch.all((out - want).abs() <= bound), float(((out - want).abs() / bound).max())
        assert torch.all(out[1, :, 4] == 0) or not padding
        # the check can fail: a P product not rounded to BF16 is beyond it somewhere
        assert not torch.all((out - unrounded).abs() <= 2.0**-12 * mag + 1e-30)


BWD_SPECS = {"mxfp4": QuantSpec.preset("mxfp4"), "nvfp4": QuantSpec.preset("nvfp4"),
             "nvfp4-sr": dataclasses.replace(QuantSpec.preset("nvfp4"), rounding="stochastic"),
             "nvfp4_2d": QuantSpec.preset("nvfp4_2d"), "none": None}


#: (dS spec, tensor cores, causal flag): every spec both ways; the causal flag (32 x 16 tiles, the query tiles
#: before each key block skipped: 1D dS blocks one tile wide) with a nearest and a stochastically rounded dS
#: and the 2D-tile dS
BWD_CASES = [(name, tc, False, True) for name in sorted(BWD_SPECS) for tc in (False, True)] + [
    ("nvfp4-sr", True, True, True), ("nvfp4", True, True, True), ("nvfp4_2d", True, True, True),
    ("nvfp4_2d", False, True, True)] + [
    # no padding mask: the tiles every row attends run unmasked (the causal diagonal's and the ragged tail masked)
    ("nvfp4-sr", True, True, False), ("nvfp4_2d", True, True, False), ("nvfp4", True, False, False),
    ("none", False, True, False)]


@pytest.mark.parametrize("name,tensor_cores,causal,padding", BWD_CASES)
def test_the_flash_backward_quantizes_its_ds_as_the_spec_and_makes_the_spec_gradients(name, tensor_cores, causal,
                                                                                      padding):
    """hf_fp4.kernels.attention.flash_backward, against the spec in float64: its dS (dumped) is the reference's
    within FP32 arithmetic; dQ and dK equal the products of *that* dS quantized by the reference quantizer
    (along keys / along queries with seed + 1 / one 2D tile for both) and K^ / Q^ within FP32 accumulation --
    so every quantized dS element in registers is the spec's, bit for bit -- and dV = bf16(P)^T dO within the
    BF16 rounding of P.  Causal + padding + a query that sees nothing, ragged T over several tiles.  tensor_cores:
    Q^, K^, V^ as exact BF16 values with NVFP4 tensor decodes and a BF16 dO, the kernels' tensor-core path, with
    the log-sum-exp the forward kernel returns (as fp4_attention runs it; otherwise phase 0's)."""
    from hf_fp4.nn.attention import _ds_operands, tensor_core_operand
    from hf_fp4.kernels.attention import flash_backward, flash_forward

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = BWD_SPECS[name]
    seed = (1 << 62) - 2 if causal else 7  # a 64-bit kernel argument (a model's AttentionRNG seeds) and a 32-bit one
    g = torch.Generator().manual_seed(11)
    t = 72
    qh, kh, vh, do = (torch.randn(1, 2, t, D, generator=g) for _ in range(4))
    decodes = None
    if tensor_cores:
        ops = [tensor_core_operand(x, QuantSpec.preset("nvfp4"), 0) for x in (qh, kh, vh)]
        qh, kh, vh = (values.float() * dec for values, dec in ops)  # the spec's values
        decodes = torch.stack([dec for _, dec in ops]).to(dev)
        do = do.to(torch.bfloat16).float()
    keep = torch.ones(1, 1, t, t, dtype=torch.bool)
    if causal or padding:
        keep = keep.tril()
    if padding:
        keep[..., :3] = False
        keep[..., 2, :] = False
    scale = D ** -0.5
    s64 = (qh.double() @ kh.double().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s64, -1), nan=0.0)
    out = (p.to(torch.bfloat16).double() @ vh.double()).float()
    ds = p * (do.double() @ vh.double().transpose(-1, -2) - (do.double() * out.double()).sum(-1, keepdim=True))
    inputs = [qh, kh, vh, out, do]
    if tensor_cores:
        inputs = [ops[0][0], ops[1][0], ops[2][0], out, do.to(torch.bfloat16)]
    # causal: only the padding part travels as a mask (a skip bound one tile short would drop queries or keys)
    kernel_keep, tile = (padding_part(keep), (32, 16)) if causal else (keep, None if padding else (32, 16))
    kernel_keep = kernel_keep.to(dev) if padding else None
    lse = None
    if tensor_cores:
        lse = flash_forward(*(x.to(dev) for x in inputs[:3]), kernel_keep, scale, decodes, tile, causal,
                            return_lse=True)[1]
        lse64 = torch.logsumexp(s64, -1)  # -inf for the query that sees nothing; the kernel's +inf marks it
        assert torch.isinf(lse[0, :, 2]).all() or not padding
        live = torch.isfinite(lse64)
        assert (lse.cpu().double()[live] - lse64[live]).abs().max() <= 1e-5
    dq, dk, dv, dbg = (x.cpu().double() for x in flash_backward(*(x.to(dev) for x in inputs), kernel_keep,
                                                                 scale, spec, seed, decodes, tile, debug=True,
                                                                 causal=causal, lse=lse))
    assert (dbg - ds).abs().max() <= 1e-5 * ds.abs().max()
    if padding:
        assert torch.all(dq[0, :, 2] == 0) and torch.all(dbg[0, :, 2] == 0)  # the query that sees nothing
    ds_keys, ds_queries = (x.double() for x in _ds_operands(dbg.float(), spec, seed))
    fp32 = t * 2.0**-24 + 2.0**-21  # FP32 accumulation over keys / queries, then the scale and decodes

    def within(got, a, b, extra=0.0):
        bound = (fp32 + extra) * (a.abs() @ b.abs()) + 1e-30
        return bool(torch.all((got - a @ b).abs() <= bound))

    assert within(dq, ds_keys * scale, kh.double())
    assert within(dk, ds_queries.transpose(-1, -2) * scale, qh.double())
    assert within(dv, p.to(torch.bfloat16).double().transpose(-1, -2), do.double(), 2.0**-7 + 1e-5)
    if spec is not None:  # the check can fail: dQ from the unquantized dS is outside it
        assert not within(dq, dbg * scale, kh.double())


def kernel_inputs(q, k, v, do, tensor_cores, dev):
    """(Q, K, V, dO, decodes) as the flash kernels take them: on the tensor cores' path NVFP4 operands as exact BF16
    values with their tensor decodes [3] (on dev) and a BF16 dO; otherwise the FP32 tensors and no decodes."""
    from hf_fp4.nn.attention import tensor_core_operand

    if not tensor_cores:
        return q, k, v, do, None
    ops = [tensor_core_operand(x, QuantSpec.preset("nvfp4"), 0) for x in (q, k, v)]
    return (*(o[0] for o in ops), do.to(torch.bfloat16), torch.stack([o[1] for o in ops]).to(dev))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_the_flash_kernels_read_grouped_key_heads_without_expanding_them(tensor_cores, causal):
    """GQA: K^, V^ with H / G heads give the same O, log-sum-exp, dQ and per-query-head dK, dV bit for bit as the
    same tensors expanded to H heads (each query head reads its group's key head; nothing is copied).
    fp4_attention sums dK, dV over each group (test_fp4_attention_on_the_triton_backend_matches_the_reference,
    GQA, against the reference's)."""
    from hf_fp4.kernels.attention import flash_backward, flash_forward

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    q, k, v, do, decodes = kernel_inputs(*(torch.randn(B, h, T, D, generator=g) for h in (H, HKV, HKV, H)),
                                         tensor_cores, dev)
    keep = None if causal else torch.rand(B, 1, T, T, generator=g) > 0.3
    keep_d = keep.to(dev) if keep is not None else None
    spec = QuantSpec.preset("nvfp4")
    results = []
    for kk, vv in ((k, v), (k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1))):
        args = [x.to(dev) for x in (q, kk, vv)]
        out, lse = flash_forward(*args, keep_d, D ** -0.5, decodes, (16, 16), causal, return_lse=True)
        grads = flash_backward(*args, out, do.to(dev), keep_d, D ** -0.5, spec, 5, decodes, (16, 16),
                               causal=causal, lse=lse)
        results.append([out, lse, *grads])
    for grouped, expanded in zip(*results):
        assert grouped.shape == expanded.shape
        assert torch.equal(grouped, expanded)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_each_backward_phase_runs_on_a_tile_of_its_own(tensor_cores):
    """flash_backward(tile={phase: tile}): the dS amax, dQ and dK / dV phases launch on tiles of their own and quantize
    the same dS as with one tile for all -- dQ and dK equal the one-tile run's within FP32 accumulation over keys /
    queries (the tiles only reorder the sums), dV likewise; a phase number outside 0-3 is refused."""
    from hf_fp4.nn.attention import _ds_operands
    from hf_fp4.kernels.attention import flash_backward, flash_forward

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    t = 80
    q, k, v, do, decodes = kernel_inputs(*(torch.randn(1, 2, t, D, generator=g) for _ in range(4)), tensor_cores, dev)
    spec = QuantSpec.preset("nvfp4")
    args = [x.to(dev) for x in (q, k, v)]
    out, lse = flash_forward(*args, None, D ** -0.5, decodes, (16, 16), True, return_lse=True)

    def grads(tile):
        return [x.cpu().double() for x in flash_backward(*args, out, do.to(dev), None, D ** -0.5, spec, 9, decodes,
                                                         tile, debug=True, causal=True, lse=lse)]

    one = grads((32, 16))
    own = grads({1: (16, 32), 2: (64, 16), 3: (16, 64)})
    assert torch.equal(one[3], own[3]) or (one[3] - own[3]).abs().max() <= 1e-6 * one[3].abs().max()  # dS itself
    ds_keys, ds_queries = (x.double() for x in _ds_operands(one[3].float(), spec, 9))
    values = [x.cpu().double() * (dec if decodes is not None else 1) for x, dec in
              zip((q, k, v), decodes.cpu() if decodes is not None else (1, 1, 1))]
    fp32 = 2 * (t * 2.0**-24 + 2.0**-21)  # both runs' accumulation error
    for got, want, bound in ((own[0], one[0], ds_keys.abs() @ values[1].abs() * D ** -0.5),
                             (own[1], one[1], ds_queries.abs().transpose(-1, -2) @ values[0].abs() * D ** -0.5),
                             (own[2], one[2], one[2].abs() + 1.0)):
        assert torch.all((got - want).abs() <= fp32 * bound + 1e-30)
    assert not torch.equal(one[0], torch.zeros_like(one[0]))
    with pytest.raises(ValueError, match="phases are 0, 1, 2, 3"):
        flash_backward(*args, out, do.to(dev), None, D ** -0.5, spec, 9, decodes, {4: (16, 16)}, causal=True, lse=lse)


@pytest.mark.parametrize("backend,compiled", [("reference", False), ("reference", True), ("triton", False)])
def test_under_autocast_fp4_attention_computes_what_it_does_on_inputs_in_the_autocast_dtype(backend, compiled):
    """As SDPA under autocast: q, k, v are cast to the autocast dtype -- a Llama's rotary embedding hands attention
    FP32 q, k and BF16 v under BF16 autocast, and the FP32 output that followed sent the flash backward to its IEEE
    path (the fullstack study run at 99k tokens/s, session 35) -- and inside the ops autocast is off (its BF16
    matmuls would change the reference's FP32 S).  Output (BF16) and gradients equal the call on BF16 inputs
    outside autocast bit for bit, compiled (fullgraph) or not; the Triton kernels in the interpreter on the CPU."""
    import torch._dynamo

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v = (t.detach().to(dev) for t in qkv(11, torch.float32))
    v = v.bfloat16()
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).bfloat16().to(dev)

    def attend(q, k, v, autocast):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            return fp4_attention(q, k, v, recipe="nvfp4", backend=backend, causal=True)

    torch._dynamo.reset()
    run = torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend
    mixed = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*mixed, True)
    out.backward(d_out)
    cast = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    want = attend(*cast, False)
    want.backward(d_out)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for name, got, ref in zip("qkv", mixed, cast):
        assert got.grad.dtype == got.dtype and torch.equal(got.grad, ref.grad.to(got.dtype)), name
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_attention_on_the_triton_backend_matches_the_reference(dtype):
    """fp4_attention(backend="triton"): the flash kernels' output and gradients match the reference path's
    (GQA, causal + padding mask; BF16 inputs take the tensor-core path, FP32 the IEEE one)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels in Triton's interpreter
    q, k, v = (t.detach().to(dev) for t in qkv(5, dtype))
    keep = torch.ones(B, 1, T, T, dtype=torch.bool, device=dev).tril()
    keep[0, :, :, :3] = False
    outs, grads = [], []
    for backend in ("reference", "triton"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fp4_attention(qq, kk, vv, keep, recipe="mxfp4", backend=backend)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append((qq.grad, kk.grad, vv.grad))
    close(outs[1], outs[0].double(), rel=1e-2)
    if dtype == torch.float32:
        assert not torch.equal(outs[1], outs[0])  # really another computation
    close(grads[1][2], grads[0][2].double(), rel=2e-2)  # dV: no quantized dS in between
    for g, w in zip(grads[1][:2], grads[0][:2]):  # dQ, dK through FP4 dS: a nudged dS may flip a rounding
        assert torch.isfinite(g).all()
        assert torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.99
    with pytest.raises(ValueError, match="unknown backend 'cuda'; valid: auto, reference, triton"):
        fp4_attention(q, k, v, keep, backend="cuda")
    auto = fp4_attention(q, k, v, keep, recipe="mxfp4", backend="auto")  # the kernels on CUDA, else the reference
    assert torch.equal(auto, outs[1] if q.is_cuda else outs[0])


def test_recipe_input_is_checked():
    with pytest.raises(ValueError, match="valid: q, k, v, ds"):
        AttentionRecipe.build({"q": "nvfp4", "dS": "nvfp4"})
    with pytest.raises(ValueError, match="unknown format 'nvfp5'; valid: none, "):
        AttentionRecipe.build({"q": "nvfp5"})
    r = AttentionRecipe.build({"q": "nvfp4", "ds": "none"})
    assert r.q == QuantSpec.preset("nvfp4") and r.k is None and r.ds is None
    assert AttentionRecipe.build(r.to_dict()) == r


def test_a_model_runs_fp4_attention_and_saves_it(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 20))
    # one config each: switching the attention, like set_attn_implementation, writes the model's config
    base = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig("bf16"))
    fp4 = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "bf16", attention="nvfp4"))
    plain = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig("bf16", attention={
        "q": "none", "k": "none", "v": "none", "ds": "none"}))
    fp4.load_state_dict(base.state_dict())
    plain.load_state_dict(base.state_dict())
    assert fp4.config._attn_implementation == "hf_fp4" and base.config._attn_implementation != "hf_fp4"
    want = base(ids).logits
    assert (plain(ids).logits - want).abs().max() < 2e-2 * want.abs().max()  # only P in BF16
    got = fp4(ids).logits
    assert not torch.allclose(got, want, atol=1e-3)  # Q, K, V quantized: a different product
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    loss = fp4(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in fp4.parameters() if p.grad is not None)
    fp4.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config._attn_implementation == "hf_fp4"
    assert again.config.quantization_config.get_recipe().attention == AttentionRecipe.build("nvfp4")
    assert torch.equal(again(ids).logits, fp4(ids).logits)


SR = {**QuantSpec.preset("nvfp4").to_dict(), "rounding": "stochastic"}
SR_ATTENTION = {"q": SR, "k": SR, "v": SR, "ds": SR}


def sr_seed(layer: int | None, step: int) -> int:
    """The spec of a model's stochastic attention seeds, in Python integers: (crc32("attention/<layer index>") +
    step * 0x5851F42D4C957F2D) mod 2^62 at the layer's step-th training call."""
    import zlib

    return (zlib.crc32(f"attention/{layer}".encode()) + step * 0x5851F42D4C957F2D) % (1 << 62)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stochastic_attention_in_a_model_draws_per_layer_from_a_step_counter(backend):
    """A stochastically rounding attention recipe in a model: each layer's call draws with the seed of its layer
    index and its training step (forward and backward: the output and the gradients of fp4_attention with that
    seed), the step advancing once per training forward and never under evaluation; two layers draw apart.
    Before: every layer drew from one host counter per module starting at 0 (the same noise in every layer),
    advanced by evaluation, lost by a resumed run.  backend "triton": the operand kernels and the flash backward
    take the seed as a device tensor (Triton's interpreter on the CPU), fp4_attention as an integer."""
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.attention import attention_forward, attention_rngs

    model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "bf16", attention=SR_ATTENTION))
    model.config.hf_fp4_attention_backend = backend
    attn = [layer.self_attn for layer in model.model.layers]
    assert sorted(attention_rngs(model)) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    q, k, v = qkv(3)
    d_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)

    def call(module, grad=True):
        qq, kk, vv = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
        with torch.set_grad_enabled(grad):
            out = attention_forward(module, qq, kk, vv, None, scaling=D ** -0.5, is_causal=True)[0].transpose(1, 2)
        if not grad:
            return out, None
        out.backward(d_out)
        return out.detach(), (qq.grad, kk.grad, vv.grad)

    def spec(layer, step):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fp4_attention(qq, kk, vv, None, D ** -0.5, SR_ATTENTION, sr_seed(layer, step), backend, causal=True)
        out.backward(d_out)
        return out.detach(), (qq.grad, kk.grad, vv.grad)

    def same(a, b):
        return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    first, second, other = call(attn[0]), call(attn[0]), call(attn[1])
    assert same(first, spec(0, 0)) and same(second, spec(0, 1)) and same(other, spec(1, 0))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[0], second[0])
    evaluated = call(attn[0], grad=False)[0]  # step 2's seed, the counter left at 2
    assert torch.equal(evaluated, spec(0, 2)[0]) and torch.equal(call(attn[0], grad=False)[0], evaluated)
    counters = {name: n for name, n in hf_fp4.rng_state_dict(model).items() if name.endswith("self_attn")}
    assert counters == {"model.layers.0.self_attn": 2, "model.layers.1.self_attn": 1}  # beside the linears


def test_a_module_of_any_class_that_calls_stochastic_attention_gets_its_own_stream():
    """A module that calls attn_implementation="hf_fp4" but is no `...Attention` class with a layer index (which
    enable() equips beforehand) gets its AttentionRNG at its first call, and draws like layer None's spec."""
    from transformers import LlamaConfig

    from hf_fp4.nn.attention import attention_forward, enable

    class Mixer(torch.nn.Module):  # holds the config, as Transformers' attention modules do
        def __init__(self):
            super().__init__()
            self.config = LlamaConfig(hidden_size=64, num_attention_heads=4)
            self.proj = torch.nn.Linear(4, 4)

    holder = torch.nn.Module()
    holder.config, holder.mixer = LlamaConfig(), Mixer()
    holder.mixer.config = holder.config
    enable(holder, SR_ATTENTION)
    assert not hasattr(holder.mixer, "_hf_fp4_attention_rng")  # not taken for an attention module beforehand
    q, k, v = (t.detach() for t in qkv(8))
    with torch.no_grad():  # evaluation: step 0, not advanced
        out = attention_forward(holder.mixer, q, k, v, None, scaling=D ** -0.5, is_causal=True)[0].transpose(1, 2)
    assert holder.mixer._hf_fp4_attention_rng.sr_calls == 0
    assert torch.equal(out, fp4_attention(q, k, v, None, D ** -0.5, SR_ATTENTION, sr_seed(None, 0), causal=True))


def test_stochastic_attention_resumes_its_stream_and_compiles_without_recompiling(corpus_files, tmp_path):
    """The trainer with a stochastically rounding attention recipe: a run stopped at step 3 and resumed logs the
    uninterrupted run's losses bit for bit (the attention counters travel in the checkpoint's RNG state), and a
    block compiled with fullgraph=True gives the eager losses step after step without recompiling (the seed is a
    device tensor the quantizers read, not a host integer the graph would specialise on)."""
    import torch._dynamo
    from test_pretrain import records, tiny_cfg
    from transformers import AutoModelForCausalLM

    from hf_fp4.train import trainer
    from hf_fp4.train.config import TrainConfig

    kw = dict(recipe="bf16", recipe_options={"attention": SR_ATTENTION}, max_steps=6, eval_every=3,
              checkpoint_every=3, schedule="constant")
    trainer.train(TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "whole", **kw)))
    trainer.train(TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "split", **{**kw, "max_steps": 3})))
    trainer.train(TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "split", **kw)), resume=True)
    whole = [(r.get("loss"), r.get("val_loss")) for r in records(tmp_path / "whole")]
    assert len(whole) >= 6 and whole == [(r.get("loss"), r.get("val_loss")) for r in records(tmp_path / "split")]

    torch._dynamo.reset()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))

    def losses(compiled):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
            "bf16", attention=SR_ATTENTION))
        if compiled:
            for block in model.model.layers:
                block.compile(backend="aot_eager", fullgraph=True, dynamic=False)
        out = []
        for _ in range(3):
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            out.append(loss.item())
        return out, hf_fp4.rng_state_dict(model)

    eager = losses(False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert losses(True) == eager and len(set(eager[0])) == 3
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stochastic_attention_on_the_gpu_never_waits_for_it():
    """On CUDA a model's stochastically rounded attention (the flash kernels) runs its forward and backward
    without a host synchronisation -- the seed is made on the device and read there by the operand kernels and the
    flash backward (torch.cuda.set_sync_debug_mode("error") raises on one) -- and computes what fp4_attention
    does with the spec's seed given as an integer."""
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.attention import attention_forward

    model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "bf16", attention=SR_ATTENTION)).cuda()
    module = model.model.layers[1].self_attn
    q, k, v = (t.detach().cuda() for t in qkv(6))
    d_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)

    def call(step):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if step is None:  # the module's stream
            out = attention_forward(module, qq, kk, vv, None, scaling=D ** -0.5, is_causal=True)[0].transpose(1, 2)
        else:
            out = fp4_attention(qq, kk, vv, None, D ** -0.5, SR_ATTENTION, sr_seed(1, step), "triton", True)
        out.backward(d_out)
        return out.detach(), qq.grad, kk.grad, vv.grad

    call(None)  # compiles the kernels (a first launch may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = call(None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert module._hf_fp4_attention_rng.sr_calls == 2
    assert all(torch.equal(a, b) for a, b in zip(got, call(1)))


def test_fullstack_is_every_piece_and_each_switches_off(corpus_files, tmp_path, monkeypatch):
    """FP4TrainConfig("fullstack"): NVFP4 linears with LoRA-SVD, FP4 attention, and (training config
    `optimizer: auto`) FP4 AdamW state; attention="none", lora_svd_rank=0, optimizer: adamw turn each off."""
    from transformers import AutoModelForCausalLM
    from test_pretrain import records, tiny_cfg

    from hf_fp4.train import trainer
    from hf_fp4.optim import FP4AdamW
    from hf_fp4.train.config import TrainConfig

    full = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig("fullstack"))
    layers = hf_fp4.fp4_modules(full)
    assert full.config._attn_implementation == "hf_fp4"
    assert all(m.lora_svd_A is not None and m.lora_svd_A.shape[0] == 16 for m in layers.values())
    assert TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "a", recipe="fullstack")).optimizer_name() == "fp4_adamw"
    off = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "fullstack", attention="none", lora_svd_rank=0))
    assert off.config._attn_implementation != "hf_fp4"
    assert all(m.lora_svd_A is None for m in hf_fp4.fp4_modules(off).values())
    assert TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "b", recipe="fullstack",
                                          optimizer="adamw")).optimizer_name() == "adamw"
    assert TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "c")).optimizer_name() == "adamw"  # nvfp4

    built = {}
    real = trainer.build_optimizer

    def spy(name, *args, **kwargs):
        built["optimizer"] = real(name, *args, **kwargs)
        return built["optimizer"]

    monkeypatch.setattr(trainer, "build_optimizer", spy)
    trainer.train(TrainConfig.from_dict(tiny_cfg(corpus_files, tmp_path / "run", recipe="fullstack", max_steps=3,
                                                 eval_every=3, checkpoint_every=3)))
    assert isinstance(built["optimizer"], FP4AdamW)
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in records(tmp_path / "run"))


def test_compiled_blocks_keep_fp4_attention_in_their_graph():
    """FP4 attention is one opaque custom op with an autograd formula: every decoder block compiles with
    fullgraph=True (a graph break would raise) and gives the eager loss bit for bit (the gradients differ through
    the compiled norms' and softmax's FP32 rounding, which FP4 rounding amplifies -- without FP4 attention too; the
    attention op's own gradients are compared in test_fp4_attention_compiles_into_one_graph_with_its_eager_values).
    Mode "auto" picks CUDA graphs for it only where it reads nothing on the host (graph_safe): the flash kernels of
    a round-to-nearest recipe on CUDA -- not the reference backend (it checks values on the host; the CPU's
    "auto"), not a stochastic recipe (the op reads its seed on the host)."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.compile import graph_safe

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "nvfp4", attention="nvfp4"))
    ids = torch.randint(0, 256, (2, 16))

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager, eager_grads = loss_and_grads()
    for block in model.model.layers:
        block.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    compiled, compiled_grads = loss_and_grads()
    assert torch.equal(compiled, eager) and len(compiled_grads) == len(eager_grads) > 0
    assert all(g.isfinite().all() for g in compiled_grads)
    # backend "auto": the flash kernels where CUDA is (graph-safe), the reference elsewhere (it reads the host)
    assert graph_safe(model) == torch.cuda.is_available()
    assert graph_safe(AutoModelForCausalLM.from_config(tiny_config()))
    model.config.hf_fp4_attention_backend = "triton"  # the flash kernels, round to nearest: no host read
    assert graph_safe(model)
    sr = {**QuantSpec.preset("nvfp4").to_dict(), "rounding": "stochastic"}
    for attention, backend in (("nvfp4", "reference"), ({"q": "nvfp4", "k": "nvfp4", "v": "nvfp4", "ds": sr},
                                                        "triton")):
        model.config.hf_fp4_attention_backend = backend
        model.config.hf_fp4_attention = attention
        assert not graph_safe(model), (attention, backend)
    torch._dynamo.reset()


def test_fp4_attention_keeps_no_tensor_alive_between_calls():
    """CUDA-graph trees require that a captured call leave nothing allocated but its outputs: a tensor a kernel
    path creates on its first call and keeps (a cache) is allocated in the graphs' memory pool when that first call
    is a warm-up under reduce-overhead -- "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs",
    the fullstack study's first step in session 31 (the round-to-nearest seeds tensor, cached per device).  Here:
    the flash path's first forward + backward (Triton's interpreter on the CPU) leaves no tensor alive once its
    outputs and gradients are dropped."""
    from tiny import clear_package_caches, live_tensors

    clear_package_caches()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    d_out = torch.randn(1, 2, 32, 64, generator=g, dtype=torch.bfloat16)
    before = live_tensors()
    out = fp4_attention(q, k, v, recipe="nvfp4", backend="triton", causal=True)
    out.backward(d_out)
    del out
    for t in (q, k, v):
        t.grad = None
    assert not live_tensors().keys() - before.keys()


def test_a_block_with_fp4_attention_compiles_without_a_graph_break_from_its_first_call():
    """enable() (FP4TrainConfig(attention=...)) and compile_model build the attention recipe on the attention
    modules, so a fresh model's compiled blocks trace in one graph from the first call (a recipe built inside the
    trace breaks the graph) and give the eager model's loss; a recipe changed after enable() is picked up by
    compile_model."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.compile import compile_model

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig("fullstack"))
    compiled = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig("fullstack"))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    for block in compiled.model.layers:
        block.compile(backend="aot_eager", fullgraph=True, dynamic=False)  # a graph break raises
    assert torch.equal(compiled(ids, labels=ids).loss, eager(ids, labels=ids).loss)

    torch._dynamo.reset()
    counters.clear()
    other = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "nvfp4", attention="nvfp4"))
    other.config.hf_fp4_attention = {"q": "mxfp4", "k": "mxfp4", "v": "none", "ds": "none"}
    compile_model(other, mode="default", backend="aot_eager")
    other(ids, labels=ids).loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert other.model.layers[0].self_attn._hf_fp4_attention_recipe[1].v is None
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("config", [dict(recipe="nvfp4", attention="nvfp4"), dict(recipe="fullstack"),
                                    pytest.param(dict(recipe="nvfp4", attention=SR_ATTENTION), id="sr-attention")],
                         ids=str)
def test_fp4_attention_blocks_replay_under_cuda_graphs_with_plain_inductors_values(config):
    """A model with round-to-nearest FP4 attention (the flash kernels) compiled under CUDA graphs
    (reduce-overhead) captures every block -- no skipped graph -- and over three steps of new batches gives the loss
    and gradients of the same blocks compiled without graphs, bit for bit (a replay that kept the first batch, or a
    host read inside the capture, would not).  The graphs run first, so a tensor a kernel path kept from its first
    call would sit in their pool (the fullstack study's first step failed that way in session 31); the fullstack
    preset adds LoRA-SVD factors to every linear.  sr-attention: stochastically rounded Q, K, V and dS, the seed a
    device tensor from the layers' step counters (session 37) -- graph_safe admits SR attention once this passes."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.compile import compile_model
    from hf_fp4.nn.swap import fp4_modules

    batches = [torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
               for s in range(3)]

    def train(mode):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
            config["recipe"], **{k: v for k, v in config.items() if k != "recipe"})).cuda()
        compile_model(model, mode=mode)
        for layer in fp4_modules(model).values():  # opaque ops in both modes: the same graphs, graphs or not
            layer.cuda_graphs = True
        steps = [[loss.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
                 for loss in cuda_train_steps(model, batches)]
        return steps, counters["inductor"]["cudagraph_skips"]

    graphs, skips = train("reduce-overhead")  # first: what a kernel path keeps from its first call is then in the
    plain, _ = train("default")                # graph pool (the fullstack study's first step, session 31)
    assert skips == 0
    assert len({float(step[0]) for step in plain}) == 3  # three batches, three losses
    for step, (a, b) in enumerate(zip(plain, graphs)):
        assert len(a) == len(b) > 1
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        assert not differ, f"step {step}: losses {float(a[0])} / {float(b[0])}, tensors {differ} of {len(a)} differ"
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe,gqa,causal", [("nvfp4", 2, True), ("mxfp4", 1, False)])
def test_fp4_attention_compiles_into_one_graph_with_its_eager_values(recipe, gqa, causal):
    """torch.compile(fullgraph=True) of fp4_attention (forward and backward through the custom ops' autograd
    formula) gives eager's output and Q, K, V gradients bit for bit, with a padding mask or causal."""
    import torch._dynamo

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 32, generator=g)
    k, v = (torch.randn(2, 4 // gqa, 24, 32, generator=g) for _ in range(2))
    keep = None if causal else (torch.arange(24) < 19).view(1, 1, 1, 24).expand(2, 1, 24, 24)
    d_out = torch.randn(q.shape, generator=g)

    def run(fn):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(d_out)
        return [out.detach(), *(t.grad for t in ins)]

    def attend(q, k, v):
        return fp4_attention(q, k, v, keep, recipe=recipe, causal=causal)

    eager = run(attend)
    compiled = run(torch.compile(attend, fullgraph=True, backend="aot_eager"))
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        assert torch.equal(a, b), name
    torch._dynamo.reset()


def test_compiling_a_model_with_fp4_attention_after_a_linear_of_another_shape():
    """compile_model compiles with static shapes: once FP4Linear.forward has been compiled for one input shape,
    a block with FP4 attention (which graph-breaks around it) used to recompile it with symbolic sizes, and torch
    2.11's dynamo failed on the autograd function (AssertionError in overwrite_tensor_vt_proxy; the GPU image
    runs torch 2.11).  The loss still equals eager."""
    import torch._dynamo
    from torch import nn
    from transformers import AutoModelForCausalLM

    from hf_fp4.nn.linear import FP4Linear
    from hf_fp4.nn.recipe import preset

    torch._dynamo.reset()
    layer = FP4Linear.from_linear(nn.Linear(64, 32), preset("ufp4").linear, name="l")
    torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.randn(8, 64, requires_grad=True)).sum().backward()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=hf_fp4.FP4TrainConfig(
        "nvfp4", attention="nvfp4"))
    ids = torch.randint(0, 256, (2, 16))
    eager = model(ids, labels=ids).loss
    hf_fp4.compile_model(model, "auto", "aot_eager")
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, eager)
    longer = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(24))
    model(longer, labels=longer).loss.backward()  # a second shape compiles once more, statically
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["nvfp4-sr", "nvfp4_2d", "mxfp4"])
def test_the_fused_quantizers_attention_operands_are_the_references(name):
    """tensor_core_operand(backend="triton") (the operand kernel's BF16 form, which the flash path uses) gives
    the reference's BF16 values and tensor decode bit for bit: stochastic rounding from the same seed, 2D blocks
    over a row count that needs padding."""
    from hf_fp4.nn.attention import tensor_core_operand

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = BWD_SPECS[name]
    x = torch.randn(2, 3, 37, D, generator=torch.Generator().manual_seed(5)) * 4
    values, decode = tensor_core_operand(x, spec, 9)
    fast_values, fast_decode = tensor_core_operand(x.to(dev), spec, 9, backend="triton")
    assert torch.equal(fast_values.cpu(), values) and torch.equal(fast_decode.cpu(), decode)
    if spec.rounding.value == "stochastic":  # the seed is used: another one moves some values
        assert not torch.equal(tensor_core_operand(x.to(dev), spec, 10, backend="triton")[0].cpu(), values)


def test_a_nan_query_makes_its_rows_output_nan_on_the_kernel_path():
    """The flash path quantizes Q, K, V without a host check (the operand kernels): a NaN makes its block NaN,
    so the rows it reaches come out NaN -- never a finite result that hides it -- and the others stay finite."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.detach().to(dev) for t in qkv(7, torch.bfloat16))
    q[0, 1, 3, 5] = float("nan")
    out = fp4_attention(q, k, v, recipe="nvfp4", backend="triton", causal=True)
    assert torch.isnan(out[0, 1, 3]).all()
    others = torch.ones(out.shape[:3], dtype=torch.bool, device=dev)
    others[0, 1, 3] = False
    assert torch.isfinite(out[others]).all()
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = fp4_attention(q, k, v, recipe="nvfp4", backend="triton", causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.isnan(dq[0, 1, 3]).all() and torch.isnan(dk).any()  # the backward does not hide it either
    assert torch.isnan(dv).any()  # bf16(P) of a NaN P is NaN (a hand rounding once made it -0.0)

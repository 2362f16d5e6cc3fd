"""Temporary GPU diagnostic (session 11): the causal SR dQ mismatch. Recovers Q(dS) from dQ = Q(dS) K scale
(K has full row rank: 72 keys < 128 dims) and compares with the reference quantization of the dumped dS."""
import dataclasses, sys, torch
sys.path.insert(0, "tests")
from hf_fp4 import QuantSpec
from hf_fp4.nn.attention import _ds_operands, tensor_core_operand
from hf_fp4.kernels.attention import flash_backward
from hf_fp4.numerics.philox import philox_noise

D = 128
for spec, tile, causal in [(dataclasses.replace(QuantSpec.preset("nvfp4"), rounding="stochastic"), (32, 16), True),
                           (QuantSpec.preset("nvfp4"), (32, 16), True), (QuantSpec.preset("nvfp4"), (32, 16), False),
                           (QuantSpec.preset("mxfp4"), (32, 32), True)]:
    g = torch.Generator().manual_seed(11)
    t = 72
    qh, kh, vh, do = (torch.randn(1, 2, t, D, generator=g) for _ in range(4))
    ops = [tensor_core_operand(x, QuantSpec.preset("nvfp4"), 0) for x in (qh, kh, vh)]
    qh, kh, vh = (values.float() * dec for values, dec in ops)
    decodes = torch.stack([dec for _, dec in ops]).cuda()
    do = do.to(torch.bfloat16).float()
    keep = torch.ones(1, 1, t, t, dtype=torch.bool).tril()
    keep[..., :3] = False
    keep[..., 2, :] = False
    scale = D ** -0.5
    s64 = (qh.double() @ kh.double().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s64, -1), nan=0.0)
    out = (p.to(torch.bfloat16).double() @ vh.double()).float()
    kk = keep | ~torch.ones(t, t, dtype=torch.bool).tril() if causal else keep
    inputs = [ops[0][0], ops[1][0], ops[2][0], out, do.to(torch.bfloat16)]
    dq, dk, dv, dbg = (x.cpu().double() for x in flash_backward(*(x.cuda() for x in inputs), kk.cuda(), scale, spec, 7,
                                                                decodes, tile, debug=True, causal=causal))
    ds_keys, ds_queries = (x.double() for x in _ds_operands(dbg.float(), spec, 7))
    # Q(dS) from dQ: dq = X (K scale)  ->  X = dq pinv(K scale)
    got = dq @ torch.linalg.pinv(kh.double() * scale)
    gotk = (dk @ torch.linalg.pinv(qh.double() * scale)).transpose(-1, -2)
    for label, g_, want in (("dQ", got, ds_keys), ("dK", gotk, ds_queries)):
        err = (g_ - want).abs()
        tol = 1e-6 * want.abs().max()
        bad = (err > tol).nonzero()
        print(f"{spec.rounding.value} {spec.scale.value} tile={tile} causal={causal} {label}: {len(bad)} of {want.numel()} quantized dS entries differ;"
              f" max err {err.max():.3g} (tol {tol:.2g})")
        for b in bad[:12].tolist():
            print("    ", b, f"got {g_[tuple(b)]:.6g} want {want[tuple(b)]:.6g} ds {dbg[tuple(b)]:.6g}")

"""FP4AdamW: AdamW whose moments are stored in NVFP4 (Full-Stack FP4's optimizer state)."""
import dataclasses
import io

import pytest
import torch

from hf_fp4 import QuantSpec, fake_quantize, quantize
from hf_fp4.optim import FP4AdamW, state_bytes
from hf_fp4.numerics.qtensor import expand_blocks

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1


def params(seed=0, shape=(64, 96)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).requires_grad_()


def grads(step, shape=(64, 96)):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(shape, generator=g) * torch.logspace(-4, 0, shape[-1])  # columns spanning 4 decades


def run(opt, p, steps, start=0):
    for s in range(start, start + steps):
        p.grad = grads(s, p.shape)
        opt.step()
    return p.detach().clone()


def test_small_parameters_keep_fp32_moments_and_follow_torch_adamw():
    a, b = params(), params()
    want = torch.optim.AdamW([a], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    got = FP4AdamW([b], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, min_numel=10 ** 9)
    torch.testing.assert_close(run(got, b, 5), run(want, a, 5), rtol=1e-6, atol=1e-7)


def stored(x):  # what NVFP4 storage keeps of x, and the decode floor of its zero codes
    q = quantize(x, "nvfp4")
    floor = (expand_blocks(q.block_decode(), (1, 16)) * q.tensor_scale)[:x.shape[0], :x.shape[1]] * 0.5 / 2
    return fake_quantize(x, "nvfp4"), floor


@pytest.mark.parametrize("transform", ["sqrt", "none"])
def test_two_steps_equal_adamw_on_moments_stored_in_nvfp4(transform):
    """Step 1 from zero moments, store Q(m) and Q(sqrt v) (or Q(v)); step 2 reads them back (zero codes of v as
    the middle of the below-grid range) -- the parameters equal AdamW computed by hand on those values."""
    p = params()
    opt = FP4AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, v_transform=transform, min_numel=1)
    w = p.detach().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t in (1, 2):
        g = grads(t - 1)
        m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
        w = w * (1 - LR * WD) - LR * (m / (1 - B1 ** t)) / ((v / (1 - B2 ** t)).sqrt() + EPS)
        m = fake_quantize(m, "nvfp4")
        sv, floor = stored(v.sqrt() if transform == "sqrt" else v)
        sv = torch.where(sv == 0, floor, sv)
        v = sv.square() if transform == "sqrt" else sv
    got = run(opt, p, 2)
    torch.testing.assert_close(got, w, rtol=2e-6, atol=1e-7)
    gm, gv = opt.moments(p)
    assert torch.equal(gm, m) and torch.allclose(gv, v, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_state_dict_round_trip_resumes_bit_for_bit(backend):
    """Six steps at once equal three, a torch.save / load of the state, and three more -- on the PyTorch path and
    on the kernels (Triton's interpreter here), whose tensor decode scales are fresh tensors every step."""
    p, q = params(), params()
    whole = FP4AdamW([p], lr=LR, min_numel=1, backend=backend)
    want = run(whole, p, 6)
    first = FP4AdamW([q], lr=LR, min_numel=1, backend=backend)
    run(first, q, 3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = FP4AdamW([q], lr=LR, min_numel=1, backend=backend)
    resumed.load_state_dict(torch.load(buf))
    assert torch.equal(run(resumed, q, 3, start=3), want)


def test_the_state_takes_about_an_eighth_of_fp32_adamw():
    p = params(shape=(256, 256))
    fp4 = FP4AdamW([p], lr=LR)
    run(fp4, p, 1, 0)
    ref = torch.optim.AdamW([p], lr=LR)
    p.grad = torch.ones_like(p)
    ref.step()
    per_param = state_bytes(fp4) / p.numel()
    assert 1.12 <= per_param <= 1.13, per_param  # 2 x (0.5 B codes + 1/16 B E4M3 scales)
    assert state_bytes(ref) / p.numel() >= 8


def test_the_sqrt_transform_keeps_more_of_a_heavy_tailed_second_moment():
    g = grads(0, (256, 256))
    v = g * g
    err = {}
    for transform in ("sqrt", "none"):
        p = torch.zeros(256, 256, requires_grad=True)
        opt = FP4AdamW([p], lr=0.0, betas=(0.0, 0.0), v_transform=transform, min_numel=1)
        p.grad = g
        opt.step()
        got = opt.moments(p)[1]
        err[transform] = ((got.sqrt() - v.sqrt()).abs() / v.sqrt().clamp_min(1e-30)).median().item()
    assert err["sqrt"] < err["none"], err


def _state_bits(opt, p):
    st = opt.state[p]
    return {k: v.reshape(-1).view(torch.uint8) for k, v in st.items() if k.endswith(
        ("_codes", "_scales", "_tensor_scale"))}


def assert_fused_step_is_the_pytorch_step(make_param, grad_of, **options):
    """Three FP4AdamW steps on the kernels and on the PyTorch path, from make_param()'s parameter with grad_of(step)
    as gradients: the parameters, codes, block scales and tensor scales equal bit for bit."""
    runs = {}
    for backend in ("triton", "reference"):
        p = make_param()
        opt = FP4AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, backend=backend, **options)
        for step in range(3):
            p.grad = grad_of(step)
            opt.step()
        runs[backend] = p.detach().clone(), _state_bits(opt, p)
    (p_fused, st_fused), (p_ref, st_ref) = runs["triton"], runs["reference"]
    bits = torch.int16 if p_ref.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(p_fused.view(bits), p_ref.view(bits))
    assert st_fused.keys() == st_ref.keys() and len(st_ref) == 6
    for key in st_ref:
        assert torch.equal(st_fused[key], st_ref[key]), key


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4", "ufp4", "int4"])
@pytest.mark.parametrize("transform,dtype", [("sqrt", torch.float32), ("none", torch.float32),
                                             ("sqrt", torch.bfloat16)], ids=str)
def test_the_fused_step_is_the_pytorch_step_bit_for_bit(spec, transform, dtype):
    """hf_fp4.kernels.optim (Triton's interpreter here) against FP4AdamW's PyTorch path: three steps of a
    parameter whose shape pads the state (37 x 83: rows to the block, columns to 16 / 32), gradients over four
    decades (zero codes in v, floored), FP32 and BF16 parameters -- the parameters, codes, block scales and tensor
    scales equal bit for bit."""
    from hf_fp4.kernels.optim import supports

    assert supports(QuantSpec.preset(spec))
    shape = (37, 83)
    assert_fused_step_is_the_pytorch_step(lambda: params(shape=shape).detach().to(dtype).requires_grad_(),
                                          lambda step: grads(step, shape).to(dtype), state_spec=spec,
                                          v_transform=transform, min_numel=1)


def assert_batched_steps_are_the_pytorch_steps(shapes, device="cpu"):
    """Parameters of `shapes` (FP32 and BF16 in turn, one joining at the second step), in two groups (the second
    without weight decay, at another lr): three FP4AdamW steps on the kernels and on the PyTorch path -- each
    parameter, code, block scale and tensor scale equal bit for bit."""
    runs = {}
    for backend in ("triton", "reference"):
        ps = [params(i, shape).to(device, [torch.float32, torch.bfloat16][i % 2]).detach().requires_grad_()
              for i, shape in enumerate(shapes)]
        groups = [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0, "lr": LR / 3}]
        opt = FP4AdamW(groups, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, backend=backend, min_numel=1)
        for step in range(3):
            for i, p in enumerate(ps):
                late = i == len(ps) - 1 and step == 0
                p.grad = None if late else grads(10 * i + step, p.shape).to(device, p.dtype)
            opt.step()
        runs[backend] = [(p.detach().clone(), _state_bits(opt, p)) for p in ps]
    assert float(opt.state[ps[-1]]["step"]) == 2 and float(opt.state[ps[0]]["step"]) == 3
    for (p_fused, st_fused), (p_ref, st_ref) in zip(runs["triton"], runs["reference"]):
        bits = torch.int16 if p_ref.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(p_fused.view(bits), p_ref.view(bits))
        assert st_fused.keys() == st_ref.keys() and len(st_ref) == 6
        for key in st_ref:
            assert torch.equal(st_fused[key], st_ref[key]), key


def test_one_launch_pair_steps_many_parameters_as_the_pytorch_path_bit_for_bit():
    """The kernels take a batch of parameters in one launch per pass (tables of tiles, addresses and sizes): five
    parameters of different shapes (one 3D, viewed as rows), FP32 and BF16, two groups, one parameter with its own
    step count (its own batch)."""
    assert_batched_steps_are_the_pytorch_steps([(37, 83), (16, 32), (3, 5, 48), (64, 16), (9, 200)])


def test_the_fused_step_is_used_where_it_applies():
    """backend "auto" on the CPU, "reference", a state spec the kernels do not take (8-bit), a non-contiguous
    parameter, a tensor subclass (FSDP2's DTensor shards) and an FP16 parameter keep the PyTorch path; "triton"
    takes the kernels (the interpreter here)."""
    p = params()
    p.grad = grads(0)
    assert FP4AdamW([p], backend="triton", min_numel=1)._fused_ready(p)
    assert not FP4AdamW([p], backend="auto", min_numel=1)._fused_ready(p)
    assert not FP4AdamW([p], backend="reference", min_numel=1)._fused_ready(p)
    assert not FP4AdamW([p], backend="triton", state_spec="mxfp8", min_numel=1)._fused_ready(p)
    q = torch.randn(96, 64).t().requires_grad_()
    q.grad = torch.randn(96, 64).t()
    assert not FP4AdamW([q], backend="triton", min_numel=1)._fused_ready(q)

    class Shard(torch.Tensor):  # a tensor subclass, as FSDP2's DTensor parameters are
        pass

    d = torch.nn.Parameter(torch.randn(64, 96).as_subclass(Shard))
    d.grad = torch.randn(64, 96).as_subclass(Shard)
    assert not FP4AdamW([d], backend="triton", min_numel=1)._fused_ready(d)
    h = torch.randn(64, 96, dtype=torch.float16).requires_grad_()
    h.grad = torch.randn(64, 96, dtype=torch.float16)
    assert not FP4AdamW([h], backend="triton", min_numel=1)._fused_ready(h)  # FP32 and BF16 parameters only
    with pytest.raises(ValueError, match="backend='cuda': valid values are auto, triton, reference"):
        FP4AdamW([p], backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 1728)], ids=str)
def test_the_fused_step_is_the_pytorch_step_at_full_size_on_gpu(shape):
    def cuda_randn(seed):
        return torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))

    assert_fused_step_is_the_pytorch_step(lambda: cuda_randn(0).requires_grad_(),
                                          lambda step: cuda_randn(1 + step) * torch.logspace(-4, 0, shape[1],
                                                                                             device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_launch_pair_steps_many_parameters_as_the_pytorch_path_on_gpu():
    """The batched launch at model sizes (bench-50m's matrices and its embedding), FP32 and BF16, two groups."""
    assert_batched_steps_are_the_pytorch_steps([(640, 640), (1728, 640), (640, 1728), (320, 640), (32000, 640),
                                                (4, 160, 640)], device="cuda")


def test_bad_options_and_non_finite_gradients_are_refused():
    with pytest.raises(ValueError, match="v_transform='log': valid values are sqrt, none"):
        FP4AdamW([params()], v_transform="log")
    p = params()
    opt = FP4AdamW([p], min_numel=1)
    p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    assert not opt.state[p]  # refused before any state changed


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_one_non_finite_element_among_many_gradients_refuses_the_step(device, bad):
    """One NaN / Inf element in one of several gradients (FP32 and BF16, quantized and FP32-moment parameters) is
    found by step()'s single check, on the CPU and on CUDA (foreach max-norm kernels), before any parameter or
    state changes; the same gradients without it step."""
    ps = [params(seed=i).to(device).to(dt).detach().requires_grad_()
          for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float32))]
    ps.append(torch.randn(40, device=device).requires_grad_())  # FP32 moments
    opt = FP4AdamW(ps, min_numel=1024)
    before = [p.detach().clone() for p in ps]
    for i, p in enumerate(ps):
        p.grad = grads(i, p.shape).to(device=device, dtype=p.dtype)
    ps[1].grad.view(-1)[777] = bad
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before)) and not any(opt.state[p] for p in ps)
    ps[1].grad.view(-1)[777] = 0.5
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(ps, before))


@pytest.mark.parametrize("magnitude,refused", [(2.0**64, True), (2.0**62, False)])
def test_a_gradient_whose_square_overflows_is_refused_and_one_below_keeps_the_state_finite(magnitude, refused):
    """The stores skip the quantizer's own non-finite check (a host read each), so step() bounds |g| first: at
    2^64, g^2 overflows FP32 and v would be Inf (a NaN block once stored); at 2^62 every moment stays finite."""
    p = params()
    before = p.detach().clone()
    opt = FP4AdamW([p], min_numel=1)
    p.grad = torch.zeros_like(p)
    p.grad.view(-1)[3] = -magnitude
    if refused:
        with pytest.raises(FloatingPointError, match="2\\^63"):
            opt.step()
        assert torch.equal(p.detach(), before) and not opt.state[p]
        return
    opt.step()
    m, v = opt.moments(p)
    assert torch.isfinite(m).all() and torch.isfinite(v).all() and torch.isfinite(p).all()
    assert v.view(-1)[3] > 0 and m.view(-1)[3] < 0


# ----------------------------------------------------------------------------------------------
# Muon
from hf_fp4.optim import Muon, newton_schulz, orthogonality_error  # noqa: E402


def spread(shape, seed=0):  # a gradient-like matrix whose singular values span two decades
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-2, 0, shape[1])


@pytest.mark.parametrize("shape", [(128, 128), (128, 384), (384, 128)])
def test_newton_schulz_in_bf16_pushes_every_singular_value_near_one(shape):
    """Five quintic steps map every singular value of g down to 1/100 of the largest into [0.6, 1.25] along g's
    own singular vectors (smaller ones stay below: Muon's known trade-off)."""
    g = spread(shape)
    u, sg, vh = torch.linalg.svd(g.double(), full_matrices=False)
    s = torch.diagonal(u.t() @ newton_schulz(g).double() @ vh.t())[sg > sg[0] / 100]
    assert len(s) > 10 and s.min() > 0.6 and s.max() < 1.25, (len(s), s.min(), s.max())


def test_muon_orthogonalises_each_same_shaped_matrix_on_its_own_in_one_batch():
    """Muon stacks its same-shaped matrices into one batched Newton-Schulz: each parameter's step equals the
    step of a Muon that holds it alone (its own norm, nothing shared across the stack), for BF16 and for
    NVFP4 operands (whose tensor scale is per matrix)."""
    shapes = [(48, 96), (48, 96), (96, 48), (48, 96)]
    for options in ({}, {"ns_spec": "nvfp4", "ns_iteration": "cubic", "ns_steps": 6}):
        together = [params(shape=s) for s in shapes]
        alone = [params(shape=s) for s in shapes]
        for i, (a, b) in enumerate(zip(together, alone)):
            a.grad = spread(shapes[i], seed=i) * (10.0 ** i)  # norms decades apart: a shared norm would show
            b.grad = a.grad.clone()
        Muon([{"params": together, "muon": True}], **options).step()
        for b in alone:
            Muon([{"params": [b], "muon": True}], **options).step()
        for a, b in zip(together, alone):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [{}, {"ns_spec": "nvfp4", "ns_iteration": "cubic", "ns_steps": 12}],
                         ids=["bf16", "nvfp4"])
def test_muon_replayed_from_cuda_graphs_steps_as_eager_muon_on_gpu(options):
    """ns_cuda_graphs (the default) replays each batch's Newton-Schulz from a captured graph: three steps with
    new gradients give the parameters eager Muon gives, bit for bit (two batches of two same-shaped matrices,
    one matrix alone)."""
    shapes = [(640, 640), (640, 640), (1728, 640), (640, 1728), (1728, 640)]

    def model():
        return [torch.randn(s, generator=torch.Generator().manual_seed(i)).cuda().requires_grad_()
                for i, s in enumerate(shapes)]

    runs = {}
    for graphs in (False, True):
        ps = model()
        opt = Muon([{"params": ps, "muon": True}], ns_cuda_graphs=graphs, **options)
        for step in range(3):
            for i, p in enumerate(ps):
                p.grad = spread(p.shape, seed=10 * step + i).cuda() * (1 + step)
            opt.step()
        runs[graphs] = ps
        assert bool(opt._graphed) == graphs
    for eager, graphed in zip(runs[False], runs[True]):
        torch.testing.assert_close(graphed, eager, rtol=0, atol=0)


def test_with_nvfp4_operands_the_cubic_iteration_converges_and_the_quintic_diverges():
    """The measured reason Muon refuses ns_spec with the quintic iteration."""
    g = spread((128, 384))
    cubic_bf16 = orthogonality_error(newton_schulz(g, 12, None, "cubic"), g)
    cubic_fp4 = orthogonality_error(newton_schulz(g, 12, "nvfp4", "cubic"), g)
    quintic_fp4 = orthogonality_error(newton_schulz(g, 5, "nvfp4", "quintic"), g)
    assert cubic_bf16 < 0.05 and cubic_fp4 < 0.2 and quintic_fp4 > 1.0, (cubic_bf16, cubic_fp4, quintic_fp4)
    with pytest.raises(ValueError, match="quintic iteration diverges with 4-bit operands"):
        Muon([{"params": [params()], "muon": True}], ns_spec="nvfp4")


def test_muon_steps_matrices_by_an_orthogonalised_update_and_the_rest_by_adamw():
    w, norm, ref = params(shape=(64, 192)), params(shape=(192,)), params(shape=(192,))
    opt = Muon([{"params": [w], "muon": True, "lr": 0.02}, {"params": [norm], "lr": LR}], betas=(B1, B2), eps=EPS)
    adamw = torch.optim.AdamW([ref], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0)
    before = w.detach().clone()
    w.grad, norm.grad, ref.grad = spread((64, 192)), grads(0, (192,)), grads(0, (192,))
    opt.step()
    adamw.step()
    s = torch.linalg.svdvals((before - w.detach()) / 0.02)  # lr * sqrt(max(1, 64 / 192)) = lr
    assert s.min() > 0.6 and s.max() < 1.25, (s.min(), s.max())
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="Muon groups take 2-D weight matrices only"):
        Muon([{"params": [params(shape=(8,))], "muon": True}])


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_newton_schulz_matmuls_run_on_the_layers_gemm_path(name):
    """quantized_matmul (Muon's NVFP4 matmul): the reference backend is exactly the product of the reference
    quantizer's operands in FP32; the fast path (operand kernels, interpreted on the CPU, and the BF16 / FP8
    GEMM) is within FP32 accumulation error of the float64 product of the same operands (the FP8 GEMM on the
    GPU: within the FP8 MMA's 14-bit accumulation, tests/exactness.py)."""
    from exactness import FP32_BITS, FP8_MMA_BITS, assert_within_accumulation_error
    from hf_fp4.nn.operands import quantized_matmul

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = spread((96, 160)).to(dev), spread((160, 80)).to(dev)
    qa, qbt = fake_quantize(a, name), fake_quantize(b.t().contiguous(), name)
    assert torch.equal(quantized_matmul(a, b, QuantSpec.preset(name), backend="reference"), qa @ qbt.t())
    pytest.importorskip("hf_fp4.kernels.operand")
    exact = quantized_matmul(a, b, QuantSpec.preset(name), backend="triton", fp8_gemms=False)
    assert_within_accumulation_error(exact, qa, qbt, f"{name} quantized_matmul")
    fast = quantized_matmul(a, b, QuantSpec.preset(name), backend="triton")  # mxfp4: the FP8 tensor cores
    fp8 = name == "mxfp4" and a.is_cuda
    assert_within_accumulation_error(fast, qa, qbt, f"{name} quantized_matmul", FP8_MMA_BITS if fp8 else FP32_BITS)
    with pytest.raises(ValueError, match="rounds to nearest"):
        quantized_matmul(a, b, dataclasses.replace(QuantSpec.preset(name), rounding="stochastic"))


@pytest.mark.parametrize("name", ["adamw", "fp4_adamw"])
def test_lora_svd_factors_train_at_their_own_lr_and_weight_decay(name):
    """The trainer's groups (hf_fp4.optim.param_groups): a LoRA-SVD layer's factors step at lr * lora_svd_lr_scale
    with weight decay lora_svd_weight_decay, its residual weight at lr with the run's decay -- each equal to a
    torch AdamW over that one tensor with those hyper-parameters (small tensors: FP4AdamW keeps FP32 moments)."""
    from hf_fp4 import preset
    from hf_fp4.nn.linear import FP4Linear
    from hf_fp4.optim import build_optimizer, param_groups

    torch.manual_seed(0)
    layer = FP4Linear.from_linear(torch.nn.Linear(32, 24, bias=False), preset("nvfp4").linear.with_options(
        lora_svd_rank=4), name="p")
    layer.lora_svd_split(fresh=True)
    model = torch.nn.ModuleDict({"p": layer})
    groups = param_groups(model, name, WD, lora_svd_lr_scale=0.25, lora_svd_weight_decay=0.5)
    opt = build_optimizer(name, groups, LR, (B1, B2), {"min_numel": 10 ** 9} if name == "fp4_adamw" else {})
    twins = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    hyper = {"p.weight": (LR, WD), "p.lora_svd_A": (LR * 0.25, 0.5), "p.lora_svd_B": (LR * 0.25, 0.5)}
    assert set(twins) == set(hyper)
    refs = {n: torch.optim.AdamW([twins[n]], lr=lr, betas=(B1, B2), weight_decay=wd) for n, (lr, wd) in hyper.items()}
    for step in range(3):
        for n, p in model.named_parameters():
            p.grad = twins[n].grad = grads(step, p.shape)
        opt.step()
        for ref in refs.values():
            ref.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), twins[n].detach(), rtol=1e-6, atol=1e-7, msg=n)


def test_small_parameters_step_together_with_the_bits_of_one_by_one(monkeypatch):
    """FP4AdamW's FP32-moment parameters (norms, biases) take one update over their concatenation per group and
    step count (_flat_step): parameters, moments and step counts equal the parameter-by-parameter path bit for bit
    -- FP32 and BF16 parameters of several shapes, two groups with their own lr / weight decay, and a parameter
    whose gradients start a step later (its own step count)."""
    from hf_fp4.optim import fp4_adamw

    def model():
        g = torch.Generator().manual_seed(4)
        shapes, dtypes = [(64,), (3, 5), (96,), (7,), (1, 9)], [torch.float32, torch.bfloat16] * 3
        return [torch.randn(s, generator=g).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]

    runs = []
    for flat in (True, False):
        if not flat:
            monkeypatch.setattr(fp4_adamw, "_flat_ready", lambda p, device: False)
        ps = model()
        opt = FP4AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.5}], lr=LR,
                       betas=(B1, B2), weight_decay=WD)
        for step in range(4):
            for i, p in enumerate(ps):
                p.grad = None if (i == 4 and step == 0) else grads(step, p.shape).to(p.dtype)
            opt.step()
        runs.append((ps, [opt.state[p] for p in ps]))
    for p, q, sp, sq in zip(runs[0][0], runs[1][0], runs[0][1], runs[1][1]):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert all(torch.equal(sp[k], sq[k]) for k in ("m", "v", "step")), sp["step"]
    assert float(runs[0][1][4]["step"]) == 3 and float(runs[0][1][0]["step"]) == 4

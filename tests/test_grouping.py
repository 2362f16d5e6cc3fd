"""The routing layout of grouped expert GEMMs (hf_fp4.nn.grouping), against a loop over experts on the host."""
import dataclasses

import pytest
import torch

from hf_fp4.nn.grouping import group_layout, padded_rows

#: where the routing kernels run: CUDA in the GPU suite, Triton's interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def loop_layout(index: torch.Tensor, num_experts: int, align: int):
    """Segments built one expert at a time: each expert's pairs (token * k + slot) in ascending order, then -1
    up to the next multiple of align; expert ids outside [0, E) dropped."""
    flat = index.reshape(-1).tolist()
    rows, offsets, tiles = [], [0], []
    for e in range(num_experts):
        pairs = [p for p, i in enumerate(flat) if i == e]
        pad = -len(pairs) % align
        rows += pairs + [-1] * pad
        tiles += [e] * ((len(pairs) + pad) // align)
        offsets.append(len(rows))
    return rows, offsets, tiles


ROUTINGS = [  # (tokens, k, experts, align, sentinels)
    (37, 2, 4, 16, False), (37, 2, 4, 1, False), (64, 4, 8, 128, True), (5, 1, 6, 32, False), (300, 8, 64, 128, True)]


@pytest.mark.parametrize("tokens,k,experts,align,sentinels", ROUTINGS)
def test_the_layout_is_the_loop_over_experts(tokens, k, experts, align, sentinels):
    g = torch.Generator().manual_seed(tokens * k + experts)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[index == 1] = 0  # expert 1 gets no tokens
    if sentinels:  # expert-parallel ids outside [0, E) are routed nowhere
        index[::7, 0] = experts
        index[::5, -1] = -1
    layout = group_layout(index, experts, align)
    rows, offsets, tiles = loop_layout(index, experts, align)
    n = layout.rows.shape[0]
    assert n == padded_rows(tokens * k, experts, align) and n >= len(rows) and n % align == 0
    assert layout.rows.tolist() == rows + [-1] * (n - len(rows))
    assert layout.offsets.tolist() == offsets
    assert layout.counts.tolist() == [int((index == e).sum()) for e in range(experts)]
    assert layout.tile_expert.tolist() == tiles + [-1] * (n // align - len(tiles))


def test_gather_and_combine_route_each_token_and_drop_the_padding():
    """combine(f(gather(x))) = sum over a token's routed slots of weight * f(x_token), in integers (exact in FP32);
    padding rows holding NaN (what a GEMM gives them from a non-finite bias) do not reach any token."""
    g = torch.Generator().manual_seed(3)
    tokens, k, experts = 23, 3, 5
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[4, 1] = -1
    weights = torch.randint(1, 5, (tokens, k), generator=g).float()
    x = torch.randint(-8, 8, (tokens, 6), generator=g).float()
    layout = group_layout(index, experts, 16)
    h = layout.gather(x)
    assert (h[~layout.valid] == 0).all()
    y = h * (layout.tokens[:, None] % 3 + 1)
    y[~layout.valid] = float("nan")
    expect = torch.zeros(tokens, 6)
    for t in range(tokens):
        for s in range(k):
            if 0 <= index[t, s] < experts:
                expect[t] += weights[t, s] * x[t] * (t % 3 + 1)
    assert torch.equal(layout.combine(y, weights, tokens), expect)


def test_gather_and_combine_gradients_sum_each_tokens_slots_and_skip_the_padding():
    """The backward of gather sums each token's rows over its slots (token_sum: a gather and an FP32 reduction,
    deterministic -- never a scatter-add of every pair, whose atomics reorder on CUDA); combine's gradients are
    weight * dOut at each pair's row and row . dOut for each weight.  Integers: exact in FP32.  The padding rows'
    gradients (NaN here) reach nothing."""
    g = torch.Generator().manual_seed(5)
    tokens, k, experts = 19, 2, 4
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[3, 0] = experts  # a pair routed nowhere
    layout = group_layout(index, experts, 16)
    x = torch.randint(-8, 8, (tokens, 5), generator=g).float().requires_grad_()
    row_grad = torch.randint(-8, 8, (layout.rows.shape[0], 5), generator=g).float()
    row_grad[~layout.valid] = float("nan")
    layout.gather(x).backward(row_grad)
    weights = torch.randint(1, 5, (tokens, k), generator=g).float().requires_grad_()
    y = torch.randint(-8, 8, (layout.rows.shape[0], 5), generator=g).float().requires_grad_()
    out_grad = torch.randint(-8, 8, (tokens, 5), generator=g).float()
    layout.combine(y, weights, tokens).backward(out_grad)
    want_x, want_y, want_w = torch.zeros(tokens, 5), torch.zeros_like(y), torch.zeros(tokens, k)
    for row, pair in enumerate(layout.rows.tolist()):
        if pair >= 0:
            t, slot = divmod(pair, k)
            want_x[t] += row_grad[row]
            want_y[row] = weights[t, slot].detach() * out_grad[t]
            want_w[t, slot] = y[row].detach() @ out_grad[t]
    assert torch.equal(x.grad, want_x)
    assert torch.equal(y.grad, want_y)
    assert torch.equal(weights.grad, want_w)


def test_the_layout_compiles_without_graph_breaks():
    """No host synchronisation and static shapes: torch.compile(fullgraph=True) traces it (a .tolist() or a
    data-dependent shape would break the graph) and gives the eager layout."""
    index = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda i: group_layout(i, 8, 16).rows, fullgraph=True, backend="eager")
    assert torch.equal(compiled(index), group_layout(index, 8, 16).rows)


def test_bad_layout_arguments_are_refused():
    with pytest.raises(ValueError, match=r"\[tokens, k\]"):
        group_layout(torch.zeros(5, dtype=torch.long), 4, 16)
    with pytest.raises(ValueError, match="align >= 1"):
        group_layout(torch.zeros(5, 2, dtype=torch.long), 4, 0)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (so that -0.0 and 0.0 differ and NaN equals itself)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _routed_case(seed: int, tokens: int = 29, k: int = 3, experts: int = 5, width: int = 40):
    """A routing with a pair routed nowhere (its weight NaN), bf16 rows with NaN in the padding rows, and random
    (not integer) values, so that rounding and summation order show."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[2, 1] = -1
    layout = group_layout(index, experts, 16)
    weights = torch.rand(tokens, k, generator=g)
    weights[2, 1] = float("nan")
    x = torch.randn(tokens, width, generator=g).bfloat16()
    y = torch.randn(layout.rows.shape[0], width, generator=g).bfloat16()
    y[~layout.valid] = float("nan")
    grad = torch.randn(tokens, width, generator=g) * 3
    return layout, weights, x, y, grad


@pytest.mark.parametrize("chunk", [16, 1024])
def test_routing_kernels_are_the_reference_bit_for_bit(chunk, monkeypatch):
    """hf_fp4.kernels.routing (Triton's interpreter here; CUDA in the GPU suite) against the torch forms of
    hf_fp4.nn.grouping: gather_rows and token_sum bit for bit (the slots summed in order, each product rounded,
    the weighted gather rounded once to BF16), pair_dot within FP32 accumulation error of the float64 dot.  Columns
    in one chunk and in three (a ragged last one)."""
    from hf_fp4.kernels import routing
    from hf_fp4.nn import grouping

    monkeypatch.setattr(routing, "BH", chunk)
    layout, weights, x, y, grad = _routed_case(11)
    k, w = layout.top_k, weights.reshape(-1)

    def on_dev(*args):
        return [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]

    for args in [(x, layout.rows, k, None, None), (grad, layout.rows, k, w, torch.bfloat16),
                 (grad, layout.rows, k, w, torch.float32)]:
        want, got = grouping.gather_rows_reference(*args), routing.gather_rows(*on_dev(*args)).cpu()
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want))
    for wk in (None, w):
        want = grouping.token_sum_reference(y, layout.pos, k, wk)
        got = routing.token_sum(*on_dev(y, layout.pos, k, wk)).cpu()
        assert want.isfinite().all() and torch.equal(bits(got), bits(want))
    got = routing.pair_dot(*on_dev(grad, y, layout.pos, k)).cpu()
    rows = y.shape[0]
    picked = y[layout.pos.clamp(max=rows - 1)].double()
    terms = grad.double().repeat_interleave(k, 0) * picked
    routed = layout.pos < rows
    exact = torch.where(routed, terms.sum(-1), 0.0)
    bound = y.shape[1] * 2.0 ** -24 * torch.where(routed, terms.abs().sum(-1), 0.0)
    assert got.isfinite().all() and ((got.double() - exact).abs() <= bound).all()
    assert (got[~routed] == 0).all()


def test_the_grouped_layers_routing_runs_on_the_kernels_as_on_the_reference(monkeypatch):
    """gather and combine with the routing kernels (KERNELS_ON_CPU: the interpreter) give the reference path's
    outputs and gradients: x's and y's bit for bit, the weights' within FP32 accumulation error."""
    from hf_fp4.nn import grouping

    layout, weights, x, y, grad = _routed_case(12)
    y = torch.where(layout.valid[:, None], y, 0.0)  # finite padding: y feeds a product below
    runs = []
    for dev, kernels in (("cpu", False), (DEV, True)):
        monkeypatch.setattr(grouping, "KERNELS_ON_CPU", kernels)
        lay = grouping.GroupLayout(**{f.name: (getattr(layout, f.name).to(dev) if isinstance(
            getattr(layout, f.name), torch.Tensor) else getattr(layout, f.name)) for f in dataclasses.fields(layout)})
        xi, yi, wi = (t.clone().to(dev).requires_grad_() for t in (x, y, weights.nan_to_num(0.5)))
        gathered = lay.gather(xi)
        out = lay.combine(yi + gathered.float().sum(-1, keepdim=True).bfloat16(), wi, x.shape[0])
        out.backward(grad.to(dev))
        runs.append([t.detach().cpu().clone() for t in (gathered, out, xi.grad, yi.grad, wi.grad)])
    for a, b in zip(runs[0][:4], runs[1][:4]):
        assert torch.equal(a, b)
    assert torch.allclose(runs[0][4], runs[1][4], rtol=1e-5, atol=1e-5)


def test_combine_refuses_weights_of_another_shape():
    layout, weights, x, y, grad = _routed_case(13)
    with pytest.raises(ValueError, match=r"weights must be \[29, 3\]"):
        layout.combine(y, weights.reshape(-1), 29)


@pytest.mark.parametrize("end", [83, 96])
def test_zero_tail_zeroes_the_rows_past_the_last_segment_and_nothing_else(end, monkeypatch):
    """zero_tail_ (the rows torch._grouped_mm leaves unwritten): the kernel (interpreter / CUDA) and the reference
    zero out[ends[-1]:] in place, on the device, and leave every other row as it was; ends[-1] == R zeroes nothing."""
    from hf_fp4.nn import grouping

    g = torch.Generator().manual_seed(4)
    out = torch.randn(96, 200, generator=g).bfloat16()
    ends = torch.tensor([10, 40, end], dtype=torch.int32)
    want = out.clone()
    want[end:] = 0
    for dev, kernels in (("cpu", False), (DEV, True)):
        monkeypatch.setattr(grouping, "KERNELS_ON_CPU", kernels)
        got = out.clone().to(dev)
        assert grouping.zero_tail_(got, ends.to(dev)) is got
        assert torch.equal(bits(got.cpu()), bits(want)), (dev, kernels)

"""The routing layout of grouped expert GEMMs (hf_fp4.nn.grouping), against a loop over experts on the host."""
import pytest
import torch

from hf_fp4.nn.grouping import group_layout, padded_rows


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

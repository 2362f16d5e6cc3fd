"""SharQ (hf_fp4.nn.sharq): the 4:8 in-pairs mask against a brute force, the two operands against the quantizer
applied by hand, the layer's product against float64, and the combinations it refuses."""
import pytest
import torch

import hf_fp4
from hf_fp4 import FP4Linear, QuantSpec, quantize
from hf_fp4.nn.recipe import preset
from hf_fp4.nn.sharq import pair_mask, sharq_operands


def brute_mask(x):
    """Per group of 8: the two pairs with the largest |a| + |b| (the lower pair on a tie), by Python loops."""
    rows, k = x.shape
    keep = torch.zeros(rows, k, dtype=torch.bool)
    for r in range(rows):
        for g in range(0, k, 8):
            sums = []
            for p in range(4):
                i = g + 2 * p
                sums.append(sum(abs(float(x[r, j])) for j in (i, i + 1) if j < k))
            best = sorted(range(4), key=lambda p: (-sums[p], p))[:2]
            for p in best:
                for j in (g + 2 * p, g + 2 * p + 1):
                    if j < k:
                        keep[r, j] = True
    return keep


def heavy(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, k, generator=g))


def test_pair_mask_keeps_the_two_largest_pairs_of_each_group():
    x = heavy(6, 45, 0)  # 45: a partial last group
    x[0, :8] = torch.tensor([1.0, -1.0, 2.0, 0.0, -2.0, 0.0, 0.5, 0.5])  # pair sums 2, 2, 2, 1: a tie
    assert torch.equal(pair_mask(x), brute_mask(x))
    assert pair_mask(x)[0, :8].tolist() == [True, True, True, True, False, False, False, False]


def test_operands_are_the_quantized_backbone_and_the_quantized_residual():
    x = heavy(8, 64, 1).to(torch.bfloat16)
    spec = QuantSpec.preset("nvfp4")
    q_sp, q_res = sharq_operands(x, spec)
    xf = x.float()
    want_sp = quantize(torch.where(brute_mask(xf), xf, 0.0), spec).dequantize(torch.float32)
    want_res = quantize(xf - want_sp, spec).dequantize(torch.float32)
    assert torch.equal(q_sp, want_sp) and torch.equal(q_res, want_res)
    # the residual is taken against the quantized backbone: the two together are nearer x than Q(x) alone
    plain = quantize(xf, spec).dequantize(torch.float32)
    assert (q_sp + q_res - xf).norm() < 0.7 * (plain - xf).norm()


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "ufp4"])
def test_the_fused_kernel_makes_both_operands_bit_for_bit(name):
    """hf_fp4.kernels.sharq against the reference (itself checked against the brute-force mask and the
    quantizer above): ties, zero groups, subnormals, a partial group and tile, bf16 and fp32 inputs, a
    strided input; NaN refused like the reference; specs the kernel does not take refused."""
    from hf_fp4.kernels.sharq import triton_sharq_operands

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = QuantSpec.preset(name)
    x = heavy(37, 101, 3)
    x[0, :8] = torch.tensor([1.0, -1.0, 2.0, 0.0, -2.0, 0.0, 0.5, 0.5])  # a tie among the pairs
    x[1, 8:16] = 0.0
    x[2, :16] = 1e-40  # subnormal: the mask sees them, the quantizer flushes them
    x[3] *= 2.0**8
    huge = x.clone()
    huge[4] *= 2.0**40  # two-level formats: the small rows' blocks fall below UE4M3
    for t in (x, x.to(torch.bfloat16), x.t().contiguous().t(), huge):
        t = t.to(dev)
        got = triton_sharq_operands(t, spec)
        want = sharq_operands(t.cpu(), spec)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), name
        # the tensor cores' parts: BF16 grid value x block scale and a tensor decode, kernel = reference, and
        # their product is the FP32 operand bit for bit
        parts = triton_sharq_operands(t, spec, parts=True)
        for (values, decode), (ref_values, ref_decode), w in zip(parts, sharq_operands(t.cpu(), spec, parts=True),
                                                                 want):
            assert values.dtype == torch.bfloat16 and torch.equal(values.cpu(), ref_values)
            assert torch.equal(decode.cpu(), ref_decode) and torch.equal(values.cpu().float() * ref_decode, w)
    bad = x.clone()
    bad[5, 7] = float("nan")
    with pytest.raises(hf_fp4.NonFiniteError):
        sharq_operands(bad, spec)
    with pytest.raises(hf_fp4.NonFiniteError):
        triton_sharq_operands(bad.to(dev), spec)
    with pytest.raises(ValueError, match="1D blocks, nearest rounding"):
        triton_sharq_operands(x.to(dev), QuantSpec.preset("nvfp4_2d"))


def test_the_layer_computes_both_products_over_one_weight_payload():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels in Triton's interpreter
    lin = torch.nn.Linear(64, 48)
    layer = FP4Linear.from_linear(lin, preset("nvfp4", gemms=("fprop",), activation_scheme="sharq").linear, name="t")
    x = heavy(10, 64, 2)
    w = quantize(lin.weight.detach(), QuantSpec.preset("nvfp4_2d")).dequantize(torch.float32).double()
    q_sp, q_res = (t.double() for t in sharq_operands(x, QuantSpec.preset("nvfp4")))
    want = q_sp @ w.t() + q_res @ w.t() + lin.bias.detach().double()
    layer.backend, layer, x = "reference", layer.to(dev), x.to(dev)
    with torch.no_grad():
        y = layer(x)
    assert (y.double().cpu() - want).abs().max() <= 1e-5 * want.abs().max()
    layer.backend = "triton"  # the fused operands (interpreted on the CPU): the same product
    with torch.no_grad():
        assert torch.equal(layer(x), y)
    with pytest.raises(RuntimeError, match="inference scheme"):
        layer(x)  # gradients flow: refused


def test_refused_combinations_say_why():
    with pytest.raises(ValueError, match="hadamard=none"):
        preset("ufp4", gemms=("fprop",), activation_scheme="sharq")
    with pytest.raises(ValueError, match="needs quantized activations"):
        preset("bf16", activation_scheme="sharq")
    with pytest.raises(ValueError, match="valid values are plain, sharq"):
        preset("nvfp4", activation_scheme="sharp")


def test_the_scheme_survives_save_and_load(tmp_path):
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    qc = hf_fp4.FP4TrainConfig("nvfp4", gemms=("fprop",), activation_scheme="sharq")
    model = AutoModelForCausalLM.from_config(tiny_config(), quantization_config=qc)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(m.recipe.activation_scheme == "sharq" for m in hf_fp4.fp4_modules(again).values())
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)


def test_a_packed_sharq_export_reloads_and_runs_sharq(tmp_path):
    """scripts/convert.py --mode ptq --sharq: the packed export records the scheme; from_pretrained runs it."""
    from tiny import tiny_config
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hf_fp4.release.evaluation import post_training_quantize
    from hf_fp4.release.export import export_fp4

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        plain = post_training_quantize(AutoModelForCausalLM.from_config(tiny_config()), "nvfp4")
        plain.load_state_dict(model.state_dict(), strict=False)
        post_training_quantize(model, "nvfp4", sharq=True)
        want = model(ids).logits
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    export_fp4(model, tok, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    layers = hf_fp4.fp4_modules(again).values()
    assert all(m.frozen_weight and m.recipe.activation_scheme == "sharq" for m in layers)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
        assert not torch.equal(plain(ids).logits, want)  # SharQ's activations differ from plain NVFP4's


def test_token_perplexity_scores_every_token_once():
    """The sliding-window protocol: every token but the first is a target exactly once; with one window it is
    the plain mean negative log-likelihood of one forward pass."""
    from tiny import tiny_config
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hf_fp4.release.evaluation import token_perplexity

    words = [f"w{i}" for i in range(200)]
    wl = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", "[EOS]"] + words)}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="[EOS]")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, 200, (n,), generator=g)) for n in (40, 31)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())
    n = len(tok("[EOS]".join(texts), add_special_tokens=False).input_ids)
    assert n == 72
    for window, stride in ((16, 8), (20, 7), (128, 64)):
        assert token_perplexity(model, tok, texts, window, stride)["tokens"] == n - 1
    ids = tok("[EOS]".join(texts), return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    assert abs(token_perplexity(model, tok, texts, 128, 64)["nll"] - float(nll)) < 1e-5


@pytest.mark.parametrize("weights_only,blocks", [(True, None), (False, "1d"), (False, None)])
def test_ptq_rows_quantize_what_their_names_say(weights_only, blocks):
    """The PTQ table's rows: W4A16 leaves x alone and quantizes W; weight_blocks "1d" gives nvfp4 1x16 weight
    blocks instead of 16x16; the default quantizes both (W4A4).  Against x and W quantized by hand."""
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    from hf_fp4.release.evaluation import post_training_quantize

    torch.manual_seed(0)
    model = post_training_quantize(AutoModelForCausalLM.from_config(tiny_config()), "nvfp4",
                                   weights_only=weights_only, weight_blocks=blocks)
    layer = model.model.layers[0].self_attn.q_proj
    x = heavy(6, layer.in_features, 4)
    with torch.no_grad():
        y = layer(x).double()
    w_spec = QuantSpec.preset("nvfp4" if blocks == "1d" else "nvfp4_2d")
    w = quantize(layer.weight.detach(), w_spec).dequantize(torch.float32).double()
    xq = x if weights_only else quantize(x, QuantSpec.preset("nvfp4")).dequantize(torch.float32)
    want = xq.double() @ w.t()
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    other = quantize(x, QuantSpec.preset("nvfp4")).dequantize(torch.float32) if weights_only else x
    assert (y - other.double() @ w.t()).abs().max() > 1e-3 * want.abs().max()  # the other choice differs
    with pytest.raises(ValueError, match="no weights-only"):
        post_training_quantize(AutoModelForCausalLM.from_config(tiny_config()), "nvfp4", sharq=True, weights_only=True)

#!/usr/bin/env python
"""Run an exported GGUF in llama.cpp and compare its next-token log-probabilities with ours.

    python scripts/gguf_llamacpp_check.py --model RUN/final --gguf OUT.gguf [--tokens 256]

Needs `llama-cpp-python` (it compiles llama.cpp; not part of the test suite).  Feeds the same token ids
(the start of the held-out split of the run's corpus, or --text) to llama.cpp and to the hf_fp4 model with
its fprop weights as exported (weight-quantized, activations in full precision), and prints the mean and
max absolute difference of the log-probabilities and both perplexities.
"""
import argparse
import math
import sys

import torch

import hf_fp4
from hf_fp4.extras import require


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the hf_fp4 model the GGUF was exported from")
    p.add_argument("--gguf", required=True)
    p.add_argument("--text", default=None, help="text to score (default: a built-in passage)")
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args(argv)
    llama_cpp = require("llama_cpp", None, "running the GGUF in llama.cpp")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = args.text or ("Now is the winter of our discontent made glorious summer by this sun of York; and all "
                         "the clouds that lour'd upon our house in the deep bosom of the ocean buried. ") * 8
    ids = tok(text, add_special_tokens=False)["input_ids"][: args.tokens]
    model = AutoModelForCausalLM.from_pretrained(args.model)
    for m in hf_fp4.fp4_modules(model).values():  # weights as exported; activations unquantized
        m.weight.data = m.dequantized_weight().to(m.weight.dtype)
        m.lora_svd_A = m.lora_svd_B = None
        m.recipe = hf_fp4.LinearRecipe()
    with torch.no_grad():
        ours = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    llm = llama_cpp.Llama(model_path=args.gguf, logits_all=True, n_ctx=max(512, len(ids)), verbose=False)
    llm.eval(ids)
    theirs = torch.log_softmax(torch.tensor(llm.scores[: len(ids)], dtype=torch.float32), -1)
    diff = (ours - theirs).abs()
    target = torch.tensor(ids[1:])
    nll = lambda lp: float(-lp[:-1].gather(1, target[:, None]).mean())  # noqa: E731
    print(f"{len(ids)} tokens: |log p (ours) - log p (llama.cpp)| mean {float(diff.mean()):.5f}, max "
          f"{float(diff.max()):.4f}; perplexity ours {math.exp(nll(ours)):.3f}, llama.cpp {math.exp(nll(theirs)):.3f}")


if __name__ == "__main__":
    sys.exit(main())

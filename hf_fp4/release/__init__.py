"""After training: exports (bf16, packed FP4, GGUF), evaluation (lm-eval, offline tasks, perplexity), model
cards and the small pretrained models the project fetches itself."""

"""The Hugging Face side: the "hf_fp4" quantization method (FP4TrainConfig + FP4HfQuantizer), registered
with transformers so that from_config / from_pretrained / save_pretrained carry the recipe."""

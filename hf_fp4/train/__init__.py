"""Pretraining: the typed training config, the flat trainer loop, data (built-in corpora, tokenizers,
shards), run comparison and convergence studies."""

"""The vocab-streaming divergences over (rows, vocab) log-probabilities: KL divergence and generalized JSD.
``rows`` holds what they share (the tile space and config, the tuning row caps, the per-row JSD math, which
the LM-head distillation losses also compute); each op module is its own spec."""

"""The losses computed from the vocabulary logits: cross-entropy on given logits, and the LM-head losses that
compute the logits in row chunks from hidden states and the head's weight, never whole (fused linear
cross-entropy, selective log-softmax, distillation, the preference and RL losses). ``chunks`` holds the chunk
machinery they share (the head's checks, the fp32-output GEMMs, the in-place gradient scaling)."""

"""The row norms: RMSNorm, fused residual add + RMSNorm, LayerNorm. ``row_norm`` holds what they share (RMSNorm's
references, the single-pass space and config, the checks); each op module is its own spec."""

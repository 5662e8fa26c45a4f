"""Optimizer updates: in-place, memory-bound steps over a parameter and its state (``adamw``)."""

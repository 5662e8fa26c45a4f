"""Runtime: device names, tuned-table lookup, custom ops and model integrations."""

"""Runtime: device names, tuned-table lookup, kernel selection and the custom-op bindings."""

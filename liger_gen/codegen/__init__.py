"""Code generation: render templates, describe search spaces and op specs, build variants (the tuner that searches
them lives in ``liger_gen.tuning``)."""

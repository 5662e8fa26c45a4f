"""Code generation: render templates, describe search spaces, build variants, tune them."""

"""The package version, in a module of its own: what records it (compiled-store manifests, benchmark JSON, the
CLI) reads it from here without importing the package, and the build reads it for the wheel's metadata."""

__version__ = "0.1.0"

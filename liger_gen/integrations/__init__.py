"""Model integrations: patching model families of other libraries (transformers) with liger_gen's ops."""

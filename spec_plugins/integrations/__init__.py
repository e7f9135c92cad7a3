"""Integrations with other libraries (transformers ``generate()``)."""

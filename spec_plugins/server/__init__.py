"""A text-generation-inference-compatible HTTP server with continuous batching and speculation
(``spec-plugins serve``; needs the ``[server]`` extra)."""

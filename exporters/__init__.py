"""Exporters (imported as ``spec_plugins.exporters``): compile verify graphs and draft heads per runtime."""

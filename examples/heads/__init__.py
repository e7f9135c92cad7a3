"""The shipped trained heads, installed as the ``spec_plugins.shipped_heads`` package (pyproject's
package-dir) so that a config naming ``examples/heads/...`` finds them from a wheel install too.
A regular package for the reason ``examples/prompts/__init__.py`` gives."""

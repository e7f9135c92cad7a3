"""The shipped prompt files, installed as the ``spec_plugins.prompts`` package (pyproject's
package-dir) so that ``tune`` and ``train`` find their default prompts from a wheel install too.
A regular package: setuptools' editable finder does not resolve a namespace package nested in a
regular one (``spec_plugins``)."""

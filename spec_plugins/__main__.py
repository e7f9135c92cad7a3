"""``python -m spec_plugins``: the ``spec-plugins`` command line, where the script is not on PATH."""

from spec_plugins.cli import app

if __name__ == "__main__":
    app(prog_name="spec-plugins")

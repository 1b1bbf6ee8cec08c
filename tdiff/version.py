"""tdiff's version, in a module of its own: what writes it (dump headers, reports, ``--version``)
imports this leaf, not the root package (which loads the capture API on first use: tdiff.hooks
would import the package that imports it). pyproject.toml reads it from here too."""

__version__ = "0.1.0"

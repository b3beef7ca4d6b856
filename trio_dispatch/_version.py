"""The package's version, one place: the package metadata reads it at build
time (``pyproject.toml``), the code and ``trio-dispatch --version`` at run time."""

__version__ = "0.1.0"

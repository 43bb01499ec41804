"""The package version, in one place: pyproject.toml reads it from here (setuptools dynamic version)."""

__version__ = "0.1.0"

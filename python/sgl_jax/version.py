"""The package version (a leaf module: what the server reports, importable from anywhere below the package)."""

__version__ = "0.1.0"

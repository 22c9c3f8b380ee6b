"""attncc's version: read by the package, the tuning cache's key, generated modules'
headers, `attncc --version` and the build (pyproject.toml), from here alone."""
__version__ = "0.1.0"

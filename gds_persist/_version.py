"""The package version, in a module of its own so that any module can import it without going
through ``gds_persist/__init__.py``."""

__version__ = "0.1.0"

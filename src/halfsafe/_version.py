"""The version, in a module of its own: nothing needs to import the package root to read it."""

__version__ = "0.1.0"

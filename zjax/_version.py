"""The version of zjax, in a module of its own so that the library can read it without importing ``zjax``."""

__version__ = "0.3.0"

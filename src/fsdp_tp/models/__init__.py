"""Models built from the library's layers, each with its unsharded twin in the same class."""

from .transformer import Transformer as Transformer

__all__ = ["Transformer"]

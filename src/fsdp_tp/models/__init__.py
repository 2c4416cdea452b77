"""Models built from the library's layers, each with its unsharded twin in the same class.

>>> import jax, jax.numpy as jnp
>>> twin = Transformer(vocab_size=256, d_model=32, num_layers=2, num_heads=2, head_dim=16,
...                    num_kv_heads=2, mlp_hidden=64)   # Layout(): the plain flax twin
>>> params = twin.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
>>> sorted(params), params["blocks"]["mlp"]["wi"]["kernel"].shape   # layers stacked by nn.scan
(['blocks', 'embed', 'head', 'norm_final'], (2, 32, 64))
"""

from .layout import Layout as Layout
from .transformer import Transformer as Transformer

__all__ = ["Layout", "Transformer"]

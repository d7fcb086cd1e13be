"""lexjax: the Length-Extrapolatable Transformer (Sun et al. 2022) in JAX/Flax."""

__version__ = "0.1.0"

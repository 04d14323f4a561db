"""Rotary position embeddings (RoPE): each pair of a head's dimensions (i, i + K/2) is rotated by the position
times a frequency of its own, so that a query-key product depends on their distance only. Frequencies are
computed in float32 as Hugging Face's Llama computes them, scaled as `model.rope_scaling` asks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """[head_dim / 2] float32 radians per position. `scaling`: model.rope_scaling as a dict (type, factor, ...)."""
    base = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    if scaling is None:
        return base
    factor = np.float32(scaling["factor"])
    if scaling["type"] == "linear":
        return base / factor
    return _llama3(base, factor, scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_len"])


def _llama3(base: np.ndarray, factor: np.float32, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3.1's: wavelengths longer than original / low are stretched by the factor, shorter than
    original / high kept, and those between interpolated smoothly."""
    wavelength = np.float32(2 * math.pi) / base
    stretched = np.where(wavelength > original / low, base / factor, base)
    smooth = (np.float32(original) / wavelength - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * stretched / factor + smooth * stretched
    medium = ~(wavelength < original / high) & ~(wavelength > original / low)
    return np.where(medium, smoothed, stretched).astype(np.float32)


def rotate(x_BxLxHxK: jax.Array, positions: jax.Array, inverse_frequencies_K2: np.ndarray) -> jax.Array:
    """x rotated by its positions ([B, L] or [L]); angles in float32, the product in x's dtype."""
    positions_BxL = positions if positions.ndim == 2 else positions[None]
    angles_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies_K2)[None, None]
    angles_BxLx1xK = jnp.concatenate([angles_BxLxK2, angles_BxLxK2], axis=-1)[:, :, None]
    cos, sin = (f(angles_BxLx1xK).astype(x_BxLxHxK.dtype) for f in (jnp.cos, jnp.sin))
    first, second = jnp.split(x_BxLxHxK, 2, axis=-1)
    return x_BxLxHxK * cos + jnp.concatenate([-second, first], axis=-1) * sin

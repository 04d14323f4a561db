"""Every JAX API that is private, experimental or changed between jax 0.10 and 0.12 is used from here, one
module per concern. Nothing else in xlatrain imports `jax._src`, `jax.experimental` or `jax.interpreters`."""

"""One module per collective: the op, its pure-JAX `reference`, and its primitive's rules."""

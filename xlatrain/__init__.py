"""xlatrain: config-driven JAX/XLA training; the whole step compiled into one XLA program. The map of the code is
docs/design.md; the command line is xlatrain.cli."""

"""PyTorch modules as JAX functions (torchax): the module bridge, its blocks for pipelines, torchax's behaviour
mended where it differs from PyTorch, and the same training in eager PyTorch (the reference side of `xlatrain
parity --against torch`, whose body is commands/torch_parity.py)."""

"""How a step becomes XLA: pure step functions, how they run over the mesh (data parallel, a pipeline), the one place
they meet jit, gradient sync, FLOP counts and what the compiler made of them. Installed as xlatrain.lowering."""

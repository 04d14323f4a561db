"""The process a run lives in: stop signals, the watchdog, jax.distributed, CPU devices, host RAM and malloc
tuning, the compile cache, GPU targets, device memory and the platform a step is compiled for."""

"""The bodies of the commands beside `train` and `config`: lower, pipeline, profile, parity (against another
config, PyTorch eager or torch_xla), export, launch; `plot` and `report` are observe/'s."""

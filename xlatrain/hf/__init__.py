"""Hugging Face checkpoints: their tensors read slice by slice into the built-in decoders' parameters
(model.init_from=hf:DIR), and the decoders' parameters written as checkpoints transformers loads
(`xlatrain export --hf`). config.json's side is xlatrain/config/hugging_face.py."""

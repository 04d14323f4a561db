"""A Hugging Face `transformers` causal language model as the torch module xlatrain trains.

Built from a configuration, never fetched from a hub: `model_type` names the architecture ("gpt2", "llama",
"qwen2", ...) and the other keyword arguments are its config's fields. The forward returns the logits alone,
the one tensor xlatrain's loss reads.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM


class CausalLM(torch.nn.Module):
    def __init__(self, model_type: str = "gpt2", **config):
        super().__init__()
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits

"""The file names of a PEFT LoRA adapter directory, for every layer that reads or writes one.

The zoo (policy layer) and the adapter store (inference layer) both check that a directory holds an
adapter; the policy layer may not import inference, so the names live here, below both.
"""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""What vLLM and `PeftModel.from_pretrained` read from an adapter directory."""

"""The model registry and pretrained language models with LoRA."""

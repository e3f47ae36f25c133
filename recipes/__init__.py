"""Fiddle GPT pretraining recipes and NeMo-Run CLI factories. Never imports torch or megatron."""

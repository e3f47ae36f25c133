"""NeMo-Run plugins (login node, submit time). Never imports torch or megatron."""

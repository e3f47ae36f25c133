"""The trainer on compute nodes: Megatron-Core model, data, optimizer, loop, checkpoints, CPU compatibility."""

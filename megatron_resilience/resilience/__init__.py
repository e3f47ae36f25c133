"""Resilience integrations on compute nodes: fault tolerance, faults, preemption, stragglers, rerun."""

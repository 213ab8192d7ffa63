"""Inference: the vLLM engine with the order constraint (and, next, the PolicyServer and adapters)."""

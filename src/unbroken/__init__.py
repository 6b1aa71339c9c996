"""unbroken: LLM pre-training on PyTorch that survives faults without leaving the failure-free trajectory."""
__version__ = "0.1.0"

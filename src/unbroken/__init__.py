"""unbroken: LLM pre-training on PyTorch that survives faults without leaving the failure-free trajectory."""
__version__ = "0.1.0"


def train(*args, **kwargs):
    """See unbroken.api.train (imported lazily so `import unbroken` stays light)."""
    from unbroken.api import train as _train
    return _train(*args, **kwargs)

"""paraplan: simulate, plan and launch parallel training plans for large models."""

__version__ = "0.1.0"

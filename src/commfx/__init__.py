"""commfx: a torch.fx compiler toolkit for distributed training communication."""

__version__ = "0.1.0"

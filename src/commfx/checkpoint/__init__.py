"""Checkpoints: save, load (at the same or another layout) and export to transformers."""

from .hf import export_hf
from .io import load, save
from .state import CheckpointError

__all__ = ["CheckpointError", "export_hf", "load", "save"]

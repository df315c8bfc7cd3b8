"""Checkpoints: save, load (at the same or another layout) and export to transformers."""

from .io import load, save
from .state import CheckpointError

__all__ = ["CheckpointError", "load", "save"]

"""The optimizer side of fsdp2: whole-matrix optimizers by owner ranks (``Muon``,
``MatrixOwners`` for your own), and gradient clipping across any mesh."""

from ._owners import MatrixOwners
from .clip import clip_grad_norm_
from .muon import Muon

__all__ = ["MatrixOwners", "Muon", "clip_grad_norm_"]

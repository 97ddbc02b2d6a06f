"""The optimizer side of fsdp2: whole-matrix optimizers by owner ranks (``Muon``,
``MatrixOwners`` for your own), and gradient clipping across any mesh."""

from ._owners import MatrixOwners
from .muon import Muon

__all__ = ["MatrixOwners", "Muon"]

"""The optimizer side of fsdp2: elementwise ``torch.optim`` steps on local shards
(``local_step``, transparent), whole-matrix optimizers by owner ranks (``Muon``,
``MatrixOwners`` for your own), and gradient clipping across any mesh."""

from ._owners import MatrixOwners
from .clip import clip_grad_norm_
from .local_step import local_step_stats
from .muon import Muon

__all__ = ["MatrixOwners", "Muon", "clip_grad_norm_", "local_step_stats"]

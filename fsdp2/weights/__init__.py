"""Weights out: a model's full weights, group by group, in few collectives
(``fsdp2.full_weights``), for an inference engine that shares the devices (a
reinforcement-learning loop) or a checkpoint writer; and held gathered for a whole
generation with the sharded model itself (``fsdp2.gathered``)."""

from .export import full_weights
from .gathered import gathered, register_gathered_method

__all__ = ["full_weights", "gathered", "register_gathered_method"]

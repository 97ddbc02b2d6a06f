"""Weights out: a model's full weights, group by group, in few collectives
(``fsdp2.full_weights``), for an inference engine that shares the devices (a
reinforcement-learning loop) or a checkpoint writer."""

from .export import full_weights

__all__ = ["full_weights"]

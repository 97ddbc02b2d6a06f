"""``FSDPModule``'s communication settings: torch 2.13's names and signatures.

Some change what fsdp2 does (the all-reduce hook, custom all-gather and reduce-scatter
collectives); the rest tune how an accelerator's collectives are issued (streams,
NCCL allocators, symmetric memory, a second communicator) where fsdp2 issues every
collective on the current stream from one flat buffer per group, or describe what
fsdp2 always does (sum reductions, zero gradients for unused parameters). Those check
their arguments and change nothing; each docstring says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CommKnobs:
    """Mixin of ``FSDPModule``: the communication settings."""

    _fsdp2_state: Any
    _target_groups: Callable[[bool], list[Any]]  # FSDPModule's: this group, or all below with recurse

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on this module's reduced gradients: after the
        reduce-scatter (1D mesh) or after the all-reduce over the replicas (HSDP), before
        they are written to ``.grad``. ``reduce_output`` is this rank's reduced row in the
        reduce dtype, modified in place by the hook (e.g. an all-reduce over another
        process group): the sharded gradients, then those of 0-dim parameters. It holds
        sums: fsdp2 divides afterwards (torch's NCCL path may average first; a linear
        hook gives the same result either way). With a hook, parameters no rank used get
        zero gradients (as with torch) rather than None. ``stream``: accepted on
        accelerators without native HSDP (fsdp2 runs the hook on the current stream);
        must be None on CPU. ``None`` removes the hook. Set it before training starts."""
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable (or None: no hook), got {type(hook).__name__}")
        group = self._fsdp2_state.group
        _check_one_mesh("set_all_reduce_hook", group, "hook")
        mesh = group.meshes[0]  # the one its parameters use (maybe not the call's own)
        if stream is not None:
            if mesh.is_hsdp:
                raise ValueError("set_all_reduce_hook(stream=...) cannot be set with native HSDP (a 2D mesh)")
            if mesh.device_type == "cpu":
                raise ValueError("set_all_reduce_hook(stream=...): streams exist on accelerators only; pass None on CPU")
        group.user_comm.all_reduce_hook = hook
        for b in group.buckets:
            b.update_direct()  # one rank without a dtype change: reduce (a copy) all the same

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gather this module's parameters with ``comm`` (torch's ``AllGather``
        protocol: ``comm.allocate(size, dtype=..., device=...)`` for the output and
        ``comm(output_tensor, input_tensor, group, async_op=True)`` returning a work
        handle), instead of fsdp2's own gathers."""
        _check_comm("set_custom_all_gather", comm)
        _check_one_mesh("set_custom_all_gather", self._fsdp2_state.group, "collective")
        _check_not_quantized("set_custom_all_gather", comm, self._fsdp2_state.group, "gather")
        self._fsdp2_state.group.user_comm.all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's
        ``ReduceScatter`` protocol: ``comm.allocate(...)`` for the output and
        ``comm(output_tensor, input_tensor, group, op, async_op=True)``), called with
        ``ReduceOp.SUM`` on fsdp2's reduce input (each rank's row: gradients, "used"
        flags, 0-dim parameters' gradients). 0-dim parameters stay equal across ranks
        only if ``comm`` sums every element in the same rank order."""
        _check_comm("set_custom_reduce_scatter", comm)
        _check_one_mesh("set_custom_reduce_scatter", self._fsdp2_state.group, "collective")
        _check_not_quantized("set_custom_reduce_scatter", comm, self._fsdp2_state.group, "reduce")
        group = self._fsdp2_state.group
        group.user_comm.reduce_scatter = comm
        for b in group.buckets:
            b.update_direct()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fsdp2 always reduces with ``ReduceOp.SUM`` and divides afterwards (no
        ``AVG`` or pre-scaling), so this changes nothing; checked for a bool."""
        check_bool("set_force_sum_reduction_for_comms", enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """``True``: trainable parameters that no rank computed a gradient for in a
        backward of their module get zero gradients instead of ``None`` (some optimizers
        and clipping code expect every parameter to have one). fsdp2 reduces unused
        parameters either way (as zeros with a zero "used" flag), so every rank issues the
        same collectives whatever its control flow, which is what torch needs this knob
        for; here it only decides ``None`` or zeros."""
        zero_unused = check_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)
        for g in self._target_groups(recurse):
            g.user_comm.zero_unused = zero_unused

    def set_post_optim_event(self, event: Any | None) -> None:
        """An event recorded after the optimizer step for the all-gather streams to wait
        on. fsdp2 issues its all-gathers on the current stream, after the step in stream
        order, so there is nothing to wait for: checked and dropped."""
        if event is not None and not isinstance(event, (torch.Event, *_cuda_event_types())):
            raise TypeError(f"set_post_optim_event expects a torch.Event (or None), got {type(event).__name__}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce inputs may be in flight at once. fsdp2 takes them from one pool
        shared by every group and keeps one reduce in flight while the next group's
        backward runs, which this knob does not change; checked for a positive int."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """A second communicator for reduce-scatters, so they overlap all-gathers on NCCL.
        fsdp2 issues both on the shard group; on gloo each collective already runs on its
        own thread. Checked for a bool; changes nothing."""
        check_bool("set_separate_reduce_scatter_group", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory staging buffers for NCCL's all-gather. fsdp2 gathers from its
        own pooled buffers; checked (only ``"NCCL"``), changes nothing."""
        if not isinstance(backend, str) or backend.upper() != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Staging buffers from the process group's allocator (NCCL zero-copy). fsdp2's
        buffers come from its own pool; checked for a bool, changes nothing."""
        check_bool("set_allocate_memory_from_process_group_for_comm", enable)


def check_bool(method: str, value: Any) -> bool:
    """``value`` as a bool: a bool, or what torch's setters take for one by its truth value
    and means it unambiguously (the ints 0 and 1, a NumPy bool). ``None``, strings and
    other numbers are refused: torch would read ``None`` as False and ``"no"`` as True."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{method} expects a bool (or 0/1), got {type(value).__name__} {value!r}")


def _check_one_mesh(method: str, group: Any, what: str) -> None:  # group: _group.ParamGroup
    """torch refuses these knobs on a module whose parameters live on several meshes
    (per-parameter meshes): one hook or collective would serve different process groups."""
    meshes = group.meshes
    if len(meshes) > 1:
        raise ValueError(
            f"{method} is not supported on a module whose parameters are sharded over {len(meshes)} meshes "
            f"(shard_placement_fn returned ShardPlacementResult): the {what} would serve different process "
            "groups. Shard the parameters of the other mesh in a fully_shard call of their own to set it"
        )


def _check_comm(method: str, comm: Any) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__ (torch's "
            f"AllGather / ReduceScatter protocol), got {type(comm).__name__}"
        )


def _cuda_event_types() -> tuple[type, ...]:
    event = getattr(getattr(torch, "cuda", None), "Event", None)
    return (event,) if isinstance(event, type) else ()


def _check_not_quantized(method: str, comm: Any, group: Any, which: str) -> None:
    """A custom collective and a quantized one cannot both carry the same payload."""
    if comm is not None and getattr(group.mp_policy, f"quantize_{which}") is not None:
        raise ValueError(
            f"{method}: this module's MixedPrecisionPolicy quantizes its {which} (quantize_{which}=...); "
            f"a custom collective would receive quantized bytes. Drop quantize_{which} from its policy, or the "
            "custom collective"
        )

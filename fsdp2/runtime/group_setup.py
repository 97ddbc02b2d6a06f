"""What a ``ParamGroup`` is built from and checked against: its buckets (one per dtype
and kind of parameter) and the checks on its parameters that need no group (offload
support, materialization, reassignment)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, cast

import torch

from .._compat import TORCH
from ..api import BlockQuantization, MixedPrecisionPolicy, OffloadPolicy
from ..bucket.bucket import FlatBucket
from ..bucket.gather import RidingGather
from ..bucket.offload import HostOffload
from ..bucket.quant.spec import NO_QUANTIZATION, QuantizedComm
from ..bucket.user_comm import UserComm
from ..comm.mesh import MeshInfo, mesh_device
from ..params.param import FSDPParam

if TYPE_CHECKING:
    from ..bucket.view import CarrierView


def build_buckets(
    params: list[FSDPParam],
    originals: list[torch.Tensor],
    comm: MeshInfo,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    user: UserComm,
) -> list[FlatBucket]:
    """One bucket per mesh and dtype (per-parameter meshes: one group per mesh, in the
    order their parameters first appear); plain parameters, subclasses over the flat
    buffer and subclasses with shards of their own (``FSDPParam.dispatched``) in buckets
    of their own. Raises before any storage is made if the offload cannot serve them."""
    compute_device = mesh_device(comm.mesh)
    if HostOffload.for_policy(offload_policy, compute_device) is not None:
        check_offloadable(params)
    by_dtype: dict[tuple[int, torch.dtype, torch.dtype, torch.dtype, tuple[torch.dtype, bool], bool, bool], list[int]] = {}
    for i, p in enumerate(params):
        compute, reduce = bucket_dtypes(p, mp_policy)
        key = (id(p.comm), p.dtype, compute, reduce, (p.grad_dtype, p.explicit_grad_dtype), p.extension, p.dispatched)
        by_dtype.setdefault(key, []).append(i)
    buckets = []
    for (_, dtype, compute, reduce, _, _, _), idx in by_dtype.items():
        floating = dtype.is_floating_point
        offload = HostOffload.for_policy(offload_policy, compute_device)  # one per bucket: its own copies
        mesh = params[idx[0]].comm
        # The policy's ``__post_init__`` made its quantize_* fields ``BlockQuantization | None``.
        gather_q, reduce_q = cast("tuple[BlockQuantization | None, BlockQuantization | None]",
                                  (mp_policy.quantize_gather, mp_policy.quantize_reduce))
        quant = QuantizedComm(gather_q, reduce_q) if floating else NO_QUANTIZATION
        bucket = FlatBucket(
            [params[i] for i in idx], [originals[i] for i in idx], mesh, device, compute, reduce, offload, quant, user
        )
        bucket.mp_policy = mp_policy
        # Dtypes the policy does not set follow the parameters' (``model.to(dtype)``).
        follows = params[idx[0]].policy_dtype is None or not floating
        bucket.follows_dtype = (follows, _reduce_follows(params[idx[0]], mp_policy, follows))
        buckets.append(bucket)
    join_reduces(buckets)
    return join_gathers(buckets)


def bucket_dtypes(p: FSDPParam, mp_policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes ``p`` is gathered (and computed) in and its gradient reduced in. Without
    a ``reduce_dtype`` the reduce follows the installed torch (``_compat``): the gradient's
    dtype (torch 2.15) or the gather's (2.13, 2.14)."""
    if not p.dtype.is_floating_point:
        return p.dtype, p.dtype
    compute = p.policy_dtype or p.dtype
    if mp_policy.reduce_dtype is not None:
        return compute, mp_policy.reduce_dtype
    return compute, (p.grad_dtype if TORCH.reduce_follows_grad_dtype else compute)


def _reduce_follows(p: FSDPParam, mp_policy: MixedPrecisionPolicy, compute_follows: bool) -> bool:
    """The reduce dtype is the parameter's own and moves with ``model.to(dtype)``."""
    if mp_policy.reduce_dtype is not None and p.dtype.is_floating_point:
        return False
    return not p.explicit_grad_dtype if TORCH.reduce_follows_grad_dtype else compute_follows


def join_gathers(buckets: list[FlatBucket]) -> list[FlatBucket]:
    """On each mesh with an all-gather extension, its first extension bucket carries the
    other buckets on that mesh (``ExtensionGather``): one all-gather, as torch sends a
    group's parameters together. Returns the buckets with each carrier moved before the
    buckets it carries (it finishes first); the order is unchanged without extensions."""
    out = list(buckets)
    for carrier in [b for b in buckets if b.extension]:
        if carrier.gather.rides:
            continue  # carried by an earlier extension bucket of its mesh
        carrier.riders = [b for b in buckets if b.comm is carrier.comm and b is not carrier]
        for r in carrier.riders:
            r.gather = RidingGather(r, cast("CarrierView", carrier))  # an extension bucket: it has one
        if carrier.riders:
            out.remove(carrier)
            out.insert(min(out.index(r) for r in carrier.riders), carrier)
    return out


def join_reduces(buckets: list[FlatBucket]) -> None:
    """On each mesh with an all-gather extension, the buckets that reduce alike (the same
    parameter dtype, hence compute dtype, and reduce dtype; no host offload) reduce as
    one: the first one's reduce carries the others' parameters (``BucketReduce.carry``),
    one collective as torch reduces a group's gradients together. Elsewhere (a group
    without extensions has one bucket per mesh and dtype) each bucket reduces its own.
    Run again when ``module._apply`` changed the buckets' dtypes (``ParamGroup.rebind``)."""
    extension_meshes = {id(b.comm) for b in buckets if b.extension}
    if not extension_meshes:
        return
    alike: dict[tuple[int, torch.dtype, torch.dtype], list[FlatBucket]] = {}
    for b in buckets:
        if id(b.comm) in extension_meshes and b.offload is None:
            alike.setdefault((id(b.comm), b.dtype, b.reduce_dtype), []).append(b)
    leads = {id(leader): riders for leader, *riders in alike.values()}
    # A leader's ``carry`` sets its riders; the rest reduce their own. Unchanged ones
    # are left alone (``carry`` returns at once).
    for b in buckets:
        if id(b) in leads:
            b.reduce.carry([r.reduce for r in leads[id(b)]])
        elif not any(b in riders for riders in leads.values()):
            b.reduce.carry([])


def rebucket(
    params: list[FSDPParam],
    old: list[FlatBucket],
    comm: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
) -> list[FlatBucket]:
    """The buckets built anew over the parameters' current shards (after some moved to
    the extension path at lazy init: ``FSDPParam.gained_extension``). The sharded
    parameters stay the same objects (swapped, as ``FlatBucket.rebind`` does), so
    optimizers built before keep working; they share the old ones' ``UserComm``."""
    current = [p.sharded for p in params]
    # Each parameter's own sharded parameter as its "original": its rows are copied.
    originals = cast("list[torch.Tensor]", current)  # every one sharded (checked below)
    buckets = build_buckets(params, originals, comm, old[0].device, mp_policy, offload_policy, old[0].user)
    for p, param in zip(params, current):
        if param is None:
            raise AssertionError("fsdp2 internal error: re-bucketing an unsharded parameter")
        fresh, grad = p.sharded, param.grad
        torch.utils.swap_tensors(param, fresh)
        param.grad = grad
        p.set_sharded(param)
        p.register_sharded()
    return buckets


def check_offloadable(params: list[FSDPParam]) -> None:
    """``CPUOffloadPolicy`` on an accelerator: tensor subclasses that gather through their
    own hooks are not offloaded yet (raised before anything changed)."""
    custom = [p.fqn for p in params if p.extension]
    if custom:
        raise NotImplementedError(
            f"fsdp2: CPUOffloadPolicy on an accelerator mesh does not support parameters whose class "
            f"defines fsdp_pre_all_gather yet ({', '.join(custom[:3])}); shard them in a fully_shard "
            "call of their own without offload_policy"
        )


def check_materialized(buckets: list[FlatBucket], mesh_type: str, name: str) -> None:
    """The sharded parameters are real tensors on the mesh's device type (the host's when
    offloaded)."""
    for b in buckets:
        device = b.sharded_flat.device
        if device.type not in ("meta", mesh_type) and (b.offload is None or device != b.offload.host):
            raise RuntimeError(
                f"fsdp2: parameters of group '{name}' are on {device} but its mesh is on "
                f"{mesh_type}; move the model with model.to({mesh_type!r}) or build the mesh "
                f"for {device.type}"
            )
        if device.type == "meta" and mesh_type != "meta":
            fqns = ", ".join(p.fqn for p in b.params[:3])
            raise RuntimeError(
                f"fsdp2: parameters ({fqns}, ...) are still on the meta device at forward; "
                "materialize them first with model.to_empty(device=...) and initialize them "
                "(e.g. reset_parameters() or load_state_dict)"
            )


class UnshardChecks:
    """What every unshard checks first, cheaply: the sharded storage is materialized
    (checked again only once a flat buffer changed, or after ``forget``), no owner
    module had a parameter reassigned, and no local tensor gained all-gather hooks."""

    def __init__(self) -> None:
        self._materialized: list[torch.Tensor] = []  # the sharded flats found materialized

    def run(self, buckets: list[FlatBucket], params: list[FSDPParam], mesh_type: str, name: str, prefix: str) -> None:
        flats = [b.sharded_flat for b in buckets]
        if len(flats) != len(self._materialized) or not all(map(operator.is_, flats, self._materialized)):
            check_materialized(buckets, mesh_type, name)
            self._materialized = flats
        check_not_reassigned(params, prefix)

    def forget(self) -> None:
        self._materialized = []


def check_not_reassigned(params: list[FSDPParam], prefix: str) -> None:
    """Every owner module still registers the parameter's sharded or unsharded tensor,
    and no plain parameter's local tensor gained all-gather hooks since lazy init, which
    took up those it found (torch looks for them at every gather; fsdp2 gathers the
    group's parameters as one flat buffer laid out then, so it says so instead of
    gathering them as plain tensors). Checked at every unshard: kept to a tight loop."""
    for fp in params:
        module, name = fp.owners[0]  # ``fp.reassigned()``, inlined
        current = module._parameters.get(name)
        if current is not None and current is not fp.sharded and current is not fp.unsharded:
            _raise_reassigned(prefix, fp)
        if not fp.extension and hasattr(fp.sharded._local_tensor, "fsdp_pre_all_gather"):  # type: ignore[union-attr]
            _raise_late_extension(prefix, fp)


def adoptable_replacements(params: list[FSDPParam]) -> bool:
    """Whether some parameter was reassigned since ``fully_shard``; each replacement is
    checked to be a DTensor like the one it replaces."""
    new = [(fp, t) for fp in params if (t := fp.reassigned()) is not None]
    for fp, t in new:
        _check_replacement(fp, t)
    return bool(new)


def _raise_reassigned(prefix: str, fp: FSDPParam) -> None:
    raise RuntimeError(
        f"fsdp2: parameter {prefix + '.' if prefix else ''}{fp.fqn} was reassigned after the model's first "
        "forward; fsdp2 adopts reassigned parameters only before it. Copy the new values into the "
        "parameter instead: with torch.no_grad(): param.copy_(distribute_tensor(value, "
        "param.device_mesh, param.placements))"
    )


def _raise_late_extension(prefix: str, fp: FSDPParam) -> None:
    raise RuntimeError(
        f"fsdp2: the local tensor of parameter {prefix + '.' if prefix else ''}{fp.fqn} gained "
        "fsdp_pre_all_gather after the model's first forward; fsdp2 takes up all-gather hooks when "
        "fully_shard runs or at the first forward only. Bind them before the first forward (to "
        "param.to_local() or its class)"
    )


def _check_replacement(fp: FSDPParam, t: torch.Tensor) -> None:
    """A reassigned parameter can replace ``fp``'s sharded one: same kind of DTensor."""
    from torch.distributed.tensor import DTensor

    same = (
        isinstance(t, DTensor)
        and t.shape == fp.shape
        and tuple(t.placements) == tuple(fp.placements)
        and t.device_mesh == fp.mesh
    )
    if not same:
        what = (
            f"a DTensor of shape {tuple(t.shape)} with placements {tuple(t.placements)}"
            if isinstance(t, DTensor)
            else f"a {type(t).__name__} of shape {tuple(t.shape)}"
        )
        raise ValueError(
            f"fsdp2: parameter {fp.fqn} was reassigned after fully_shard with {what}; it must be a "
            f"DTensor like the sharded one it replaces (shape {tuple(fp.shape)}, placements "
            f"{tuple(fp.placements)}): nn.Parameter(distribute_tensor(value, param.device_mesh, "
            "param.placements))"
        )

"""The tensor-subclass all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, as torchao's float8 weights use it), at 2 ranks on a 1-D mesh
and at 4 on HSDP (2 x 2), with fsdp2 and with torch's ``fully_shard`` in the same
ranks: the hooks run on every gather, on the thread that runs the forward, with the
shard dim's 1-D mesh, called on the parameter's own local tensor (state kept there is
seen); the sharded parameters keep their class, and training matches local training in
float64, with uneven shards, mixed precision on, the older one-argument signature,
subclasses of two inner tensors or an ``__tensor_unflatten__`` of their own, hooks bound
to a plain tensor after ``fully_shard`` (and ``to_empty``), on a 1-D mesh and on HSDP
(2 x 2). A group mixing extension and plain parameters sends one all-gather and one
reduce, as torch's does: fsdp2 issues as many all-gathers as torch, of no more bytes,
and no more reduces, of no more bytes than torch's plus its "used" flags, in every case."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import _subclass
import pytest
import torch
import torch.nn as nn
from _comm import CommCounter
from _dist import cached_outcome, run_ranks
from _models import batch, copy_full_into_sharded, full_params, impl, loss_fn
from _models import worst as _worst
from torch.distributed.device_mesh import init_device_mesh

import fsdp2

LIBS = ("fsdp2", "torch")
CASES = {
    "even": dict(cls="Doubled", hidden=8),
    "uneven": dict(cls="Doubled", hidden=7),
    "old_signature": dict(cls="OldSignature", hidden=8),
    "reshard_false": dict(cls="Doubled", hidden=8, raf=False),
    # param_dtype float32 (passed to the hooks) against float64 local training
    "mixed_precision": dict(cls="Doubled", hidden=7, mp=True, tol=1e-5),
    # set_custom_all_gather: the extension's inputs travel through the user's collective
    "custom_all_gather": dict(cls="Doubled", hidden=8, custom=True),
    # sharded through the subclass's own ops (torch's way), not rebuilt around a flat buffer
    "two_inner_tensors": dict(cls="Pair", hidden=8),
    "two_inner_tensors_uneven": dict(cls="Pair", hidden=7),
    "two_inner_tensors_hsdp": dict(cls="Pair", hidden=7, hsdp=True),
    "own_unflatten": dict(cls="OwnUnflatten", hidden=7),
    # fsdp_pre_all_gather keeps per-thread state: called on the forward's thread
    "thread_local": dict(cls="ThreadLocal", hidden=8),
    "thread_local_hsdp": dict(cls="ThreadLocal", hidden=8, hsdp=True),
    # state set on param._local_tensor after each step (torchao's precomputed scale)
    "state_on_local": dict(cls="Stateful", hidden=7),
    # plain weights whose local tensors get hooks bound after fully_shard (torch's tests'
    # monkey patch): after to_empty from the meta device, and on HSDP
    "late_hooks": dict(cls=None, hidden=7, late=True, meta=True),
    "late_hooks_hsdp": dict(cls=None, hidden=7, late=True, hsdp=True),
    # one group of both kinds (fc1 rebuilt over the flat buffer, fc2 sharded by its own
    # ops) and plain biases: one all-gather carries all three buckets
    "mixed_kinds": dict(cls="Doubled", cls2="Pair", hidden=7, one_group=True),
    # the subclass lets its gathered outputs go right after fsdp_post_all_gather (torch
    # 2.15's hook; torch 2.13 ignores it): kept gathered after forward, they are freed
    "release_outputs": dict(cls="Releasing", hidden=8, raf=False),
}
WORLD = 4  # HSDP's 2 x 2
# The cases on a 1-D mesh run at 2 ranks (as they did before the HSDP ones came): 4 add
# no code path there (7 rows are uneven over 2 as over 4) and cost twice the processes.
def _world(cfg: dict[str, Any]) -> int:
    return WORLD if cfg.get("hsdp") else 2


# Two steps: the first, and one whose gathers see the state the first step left on the
# local tensors (``Stateful``) and whose reduces run in steady state (a third repeated
# the second).
STEPS = 2


class Gather:
    """torch's AllGather protocol over ``all_gather_into_tensor``, noting output sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self.sizes.append(output_tensor.numel() * output_tensor.element_size())
        return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, hidden)
        self.fc2 = nn.Linear(hidden, 12)  # 12 classes (11 used): even rows over 2 ranks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids))))


def _wrap_weights(model: Net, classes: tuple[type, type]) -> None:
    for layer, cls in zip((model.fc1, model.fc2), classes):
        make = getattr(cls, "make", cls)
        layer.weight = nn.Parameter(make(layer.weight.detach().clone()))


# Ranks that are threads of one process (``test_threaded``) share the random generator.
INIT_LOCK = threading.Lock()


def _run(lib: Any, rank: int, world: int, cfg: dict[str, Any], count: bool = False) -> dict[str, Any]:
    """One case; ``count``: the collectives too (not with threads for ranks)."""
    with INIT_LOCK:
        torch.manual_seed(0)
        ref = Net(cfg["hidden"]).double()
        with torch.device("meta" if cfg.get("meta") else "cpu"):
            model = Net(cfg["hidden"]).double()
    if not cfg.get("meta"):
        model.load_state_dict(ref.state_dict())
    classes = tuple(getattr(_subclass, c) if c else torch.Tensor for c in (cfg["cls"], cfg.get("cls2", cfg["cls"])))
    if cfg["cls"]:
        _wrap_weights(model, classes)  # type: ignore[arg-type]
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.float32) if cfg.get("mp") else lib.MixedPrecisionPolicy()
    shape, names = ((2, world // 2), ("replicate", "shard")) if cfg.get("hsdp") else ((world,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    groups = [[model.fc1, model.fc2]] if cfg.get("one_group") else [model.fc1, model.fc2]
    for modules in groups:
        lib.fully_shard(modules, mesh=mesh, reshard_after_forward=cfg.get("raf", True), mp_policy=mp)
    lib.fully_shard(model, mesh=mesh, mp_policy=mp)
    if cfg.get("meta"):
        model.to_empty(device="cpu")
        copy_full_into_sharded(model, dict(ref.named_parameters()), rank, world)
    bound = []
    if cfg.get("late"):  # after fully_shard and to_empty, on the objects the user sees
        bound = [layer.weight._local_tensor for layer in (model.fc1, model.fc2)]
        for local in bound:
            _subclass.bind_hooks(local)
    gather = Gather()
    if cfg.get("custom"):
        for layer in (model.fc1, model.fc2):
            layer.set_custom_all_gather(gather)
    kept_class = all(type(layer.weight.to_local()) is c for layer, c in zip((model.fc1, model.fc2), classes))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    _subclass.calls.update(pre=0, post=0, post_out=0)
    _subclass.seen.meshes = []
    _subclass.tags_seen.clear()
    counter = CommCounter()
    held: list[int] = []
    _subclass.Releasing.last_outputs = []
    with counter.active() if count else contextlib.nullcontext():
        for step in range(STEPS):
            ids, targets = batch(step, 2 * world)
            loss_fn(ref(ids), targets).backward()
            loss = loss_fn(model(ids.chunk(world)[rank]).double(), targets.chunk(world)[rank])
            held.append(_subclass.outputs_held())  # after forward, parameters still gathered
            loss.backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            # State on the local tensor after the step, as torchao's precomputed scale is
            # (``Stateful``; torch's lazy init may replace a padded rank's local tensor).
            for layer in (model.fc1, model.fc2):
                layer.weight._local_tensor.tag = step + 1
    got, want = full_params(model), full_params(ref)
    worst = _worst([(_plain(got[n]) - want[n]).abs().max().item() for n in want])
    pairs = [got[n] for n in want if isinstance(got[n], _subclass.Pair)]
    meshes = getattr(_subclass.seen, "meshes", [])
    return {
        "pair_gap": _worst([0.0] + [(t.a - t.b).abs().max().item() for t in pairs]),  # a == b throughout
        # (hook calls seen on this thread, 1-D meshes of the shard dim's size among them)
        "thread_meshes": (len(meshes), sum(m.ndim == 1 and m.size() == shape[-1] for m in meshes)),
        "worst": worst,
        "kept_class": kept_class
        and all(type(layer.weight.to_local()) is c for layer, c in zip((model.fc1, model.fc2), classes))
        # hooks bound late: still the very objects they were bound to
        and all(layer.weight._local_tensor is t for layer, t in zip((model.fc1, model.fc2), bound)),
        "tags_seen": list(_subclass.tags_seen),
        # (all-gathers, their bytes) in STEPS steps
        "gathers": (counter.calls["all_gather"], counter.bytes["all_gather"]),
        # (reduces, their bytes) in STEPS steps, and how many parameters there are
        "reduces": (counter.calls["reduce"], counter.bytes["reduce"]),
        "n_params": len(list(model.parameters())),
        "calls": dict(_subclass.calls),
        # bytes through the custom collective per call: the weights' inputs included
        "custom_bytes": max(gather.sizes, default=0),
        "outputs_held": held,
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, _subclass.Pair):
        return t.a
    return t._inner if isinstance(t, _subclass.Doubled) else t


def _bound_after_first_forward(rank: int, world: int) -> dict[str, Any]:
    """Hooks bound to a plain weight's local tensor after the first forward: the next
    unshard raises before anything changed, and the module still shows its shards."""
    torch.manual_seed(0)
    model = Net(8).double()
    for layer in (model.fc1, model.fc2):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    ids, _ = batch(0, 2 * world)
    model(ids.chunk(world)[rank]).sum().backward()
    sharded = model.fc1.weight
    _subclass.bind_hooks(sharded._local_tensor)
    try:
        model(ids.chunk(world)[rank])
    except RuntimeError as e:
        return {"error": str(e), "still_sharded": model.fc1.weight is sharded}
    return {"error": None}


def _worker(rank: int, world: int) -> dict[str, Any]:
    """The cases of this world size, for both libraries, then the joined reduce's corners
    (their own world once: a spawn saved), last: the in-place one stays on in the process."""
    out: dict[str, Any] = {
        lib_name: {
            name: _run(impl(lib_name), rank, world, cfg, count=True)
            for name, cfg in CASES.items()
            if _world(cfg) == world
        }
        for lib_name in LIBS
    }
    if world == 2:
        out["bound_after_first_forward"] = _bound_after_first_forward(rank, world)
    out["joined"] = {name: _joined(rank, world, cfg) for name, cfg in JOINED.items() if _world(cfg) == world}
    return out


@cached_outcome
def _spawned(world: int) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_worker, world)


def _outs(case: str) -> list[dict[str, Any]]:
    return _spawned(_world(CASES[case]))


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("case", list(CASES))
def test_subclass_all_gather_extension(lib_name: str, case: str) -> None:
    for out in _outs(case):
        res = out[lib_name][case]
        assert res["worst"] <= CASES[case].get("tol", 1e-12), res
        assert res["kept_class"], res
        calls = res["calls"]
        assert calls["pre"] >= STEPS * 2 and calls["post"] + calls["post_out"] == calls["pre"], res
        assert res["pair_gap"] == 0, res
        if CASES[case]["cls"] == "ThreadLocal" or CASES[case].get("late"):
            assert res["thread_meshes"] == (calls["pre"], calls["pre"]), res
        if CASES[case].get("custom"):
            assert res["custom_bytes"] >= 2 * 8 * 6 * 16, res  # fc1's values (f64) and tags (i64), 2 ranks
        if CASES[case]["cls"] == "Releasing" and (lib_name == "fsdp2" or hasattr(impl("torch"), "GradientReductionHandle")):
            assert res["outputs_held"] == [0] * STEPS, res  # fsdp2, and torch from 2.15
        if CASES[case]["cls"] == "Stateful":  # every gather of step s > 0 saw the tag set after step s-1
            k = len(res["tags_seen"]) // STEPS
            assert k and res["tags_seen"] == [tag for tag in [None, *range(1, STEPS)] for _ in range(k)], res


def test_hooks_bound_after_the_first_forward_are_refused_before_anything_changes() -> None:
    for out in _spawned(2):
        res = out["bound_after_first_forward"]
        assert res["error"] is not None and "fc1.weight gained fsdp_pre_all_gather after" in res["error"], res
        assert "Bind them before the first forward" in res["error"] and res["still_sharded"], res


@pytest.mark.parametrize("case", list(CASES))
def test_one_all_gather_per_group_as_torch(case: str) -> None:
    """fc1's and fc2's groups mix extension weights with plain biases: one all-gather per
    unshard, as torch's, of no more bytes."""
    for out in _outs(case):
        ours, torch_s = out["fsdp2"][case]["gathers"], out["torch"][case]["gathers"]
        assert ours[0] == torch_s[0] and ours[1] <= torch_s[1], (ours, torch_s)


@pytest.mark.parametrize("case", list(CASES))
def test_one_reduce_per_group_as_torch(case: str) -> None:
    """A group of extension weights and plain biases reduces its gradients in one
    collective, as torch's does (before, one per bucket: 2 or 3 per group). Bytes: no
    more than torch's plus fsdp2's "used" flags, one float64 per parameter per rank
    (per reduce, each parameter's flag travels once: ``STEPS x W x n_params x 8``)."""
    for out in _outs(case):
        ours, torch_s = out["fsdp2"][case]["reduces"], out["torch"][case]["reduces"]
        flags = STEPS * _world(CASES[case]) * out["fsdp2"][case]["n_params"] * 8
        assert ours[0] <= torch_s[0] and ours[1] <= torch_s[1] + flags, (ours, torch_s, flags)


# The joined reduce's corners (``BucketReduce.carry``): each a fully_shard of fc1 and fc2
# (Doubled weights, plain biases: two buckets, one reduce) against float64 local training.
JOINED = {
    "plain": {},
    # accumulated without synchronization in the reduce dtype (float64, not the float32
    # compute dtype): the leader defers its riders' gradients too
    "accumulate_mp": {"mp": True, "micro": 2, "tol": 1e-5},
    "frozen_bias": {"frozen": True},  # a rider's parameter left out of the layout
    "hsdp_accumulate": {"hsdp": True, "micro": 2},  # set_requires_all_reduce(False) first
    # gloo's in-place strategy applies to the bias buckets: they ride, so they must not lend
    "in_place": {"in_place": True},
}


def _joined(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from _models import force_in_place

    import fsdp2

    if cfg.get("in_place"):
        force_in_place()  # this rank's process only, and the last scenario
    torch.manual_seed(0)
    ref = Net(7).double()
    model = Net(7).double()
    model.load_state_dict(ref.state_dict())
    if cfg.get("frozen"):
        for m in (ref, model):
            m.fc1.bias.requires_grad_(False)
    _wrap_weights(model, (_subclass.Doubled, _subclass.Doubled))
    mp = fsdp2.MixedPrecisionPolicy()
    if cfg.get("mp"):
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    shape, names = ((2, world // 2), ("replicate", "shard")) if cfg.get("hsdp") else ((world,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for m in (model.fc1, model.fc2, model):
        fsdp2.fully_shard(m, mesh=mesh, mp_policy=mp)
    riders = [b for m in (model.fc1, model.fc2) for b in m._fsdp2_state.group.buckets if not b.extension]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    micro, reduces, flat_ok = cfg.get("micro", 1), [], []
    for step in range(STEPS):
        ids, targets = batch(step, 2 * micro * world)
        loss_fn(ref(ids), targets).backward()
        counter = CommCounter()
        with counter.active():
            shards = list(zip(ids.chunk(world)[rank].chunk(micro), targets.chunk(world)[rank].chunk(micro)))
            for mb, (i, t) in enumerate(shards):
                last = mb == micro - 1
                if cfg.get("hsdp"):
                    model.set_requires_all_reduce(last)
                else:
                    model.set_requires_gradient_sync(last)
                (loss_fn(model(i).double(), t) / micro).backward()
        reduces.append(counter.calls["reduce"])
        # The riders' flat gradient (the optimizer's one-tensor step) is theirs, in place.
        for b in riders:
            flat = b.commit.flat_grad()
            if flat is None or not all(p.sharded.requires_grad for p in b.params):
                flat_ok.append(flat is None and not b.params[0].sharded.requires_grad)  # frozen: none
                continue
            spans = [(flat[p.offset : p.offset + p.layout.local_numel], p.sharded.grad) for p in b.params]
            flat_ok.append(all(torch.equal(f, g.to_local().reshape(-1)) for f, g in spans))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    return {
        "worst": _worst([(_plain(got[n]) - want[n]).abs().max().item() for n in want]),
        "reduces": reduces,
        "flat_ok": flat_ok,
        "riders_in_place": all(b.in_place is not None for b in riders),
    }


def _joined_spawned() -> dict[str, list[dict[str, Any]]]:
    return {name: [out["joined"][name] for out in _spawned(_world(cfg))] for name, cfg in JOINED.items()}


@pytest.mark.parametrize("case", list(JOINED))
def test_joined_reduce(case: str) -> None:
    """Matches local training; one reduce per group (fc1, fc2, the root) each time
    gradients are reduced, as torch's: once a step, or with HSDP's
    ``set_requires_all_reduce(False)`` a reduce-scatter each micro-batch and the
    all-reduce once; the riders' flat gradients hold their parameters' gradients."""
    cfg = JOINED[case]
    groups, micro = 3, cfg.get("micro", 1)
    want = groups * (micro + 1) if cfg.get("hsdp") else groups
    for out in _joined_spawned()[case]:
        assert out["worst"] <= cfg.get("tol", 1e-12), out
        assert out["reduces"] == [want] * STEPS, out
        assert out["flat_ok"] and all(out["flat_ok"]), out
        assert out["riders_in_place"] == bool(cfg.get("in_place")), out

"""Quantized communication (``MixedPrecisionPolicy(quantize_gather=..., quantize_reduce=...)``):
the machinery, checked bit for bit, apart from convergence (``tools/quant_convergence.py``).

* the blockwise scheme against a block-by-block numpy reference (int8 with numpy's
  rounding, float8 e4m3 with an independent rounding to 3 mantissa bits);
* at 2 ranks, float64: the gathered parameters equal every rank's dequantized shards, the
  reduced gradients equal the rank-ordered float32 sum of the dequantized rows, the bytes
  on the wire, world size 1 untouched, and the errors;
* composition (at 4 ranks HSDP, integer reshard, dp x tp and per-parameter meshes; at 2
  bf16, offload, activation checkpointing, clipping, Muon and compile; state dicts at
  both): training stays within the quantization error of the same model unquantized,
  every value finite.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _comm import CommCounter
from _dist import cached_outcome, run_ranks, run_scenarios
from torch import nn

import fsdp2
from fsdp2.bucket.quant.blockwise import dequantize_into, quantize_rows
from fsdp2.bucket.quant.spec import BlockQuantization, RowLayout

QMAX = {"int8": 127.0, "fp8": 448.0}
TINY = np.float32(np.finfo(np.float32).tiny)


# --------------------------------------------------------------------- reference
def _round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float32 values (|v| <= 448) to float8 e4m3fn, half to even, independently of
    torch: 3 mantissa bits, subnormals below 2**-6 in steps of 2**-9."""
    out = np.zeros(v.shape, dtype=np.float64)
    a = np.abs(v.astype(np.float64))
    nz = (a > 0) & np.isfinite(a)
    _, ex = np.frexp(a[nz])
    ulp = np.exp2(np.maximum(ex - 1, -6) - 3)
    out[nz] = np.rint(a[nz] / ulp) * ulp
    out = np.copysign(out, v)
    out[~np.isfinite(a)] = np.nan
    return out.astype(np.float32)


def reference(x: torch.Tensor, kind: str, block: int, sizes: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized values, scales) of one row, segment by segment (each starts a block),
    block by block."""
    v = x.to(torch.float64).numpy().astype(np.float32)
    values, scales, start = [], [], 0
    for n in sizes or (v.size,):
        got, sc = _reference_segment(v[start : start + n], kind, block)
        values.append(got)
        scales.append(sc)
        start += n
    return np.concatenate(values), np.concatenate(scales)


def _reference_segment(v: np.ndarray, kind: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    n = v.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = v
    out = np.empty_like(padded)
    scales = np.empty(blocks, dtype=np.float32)
    for i in range(blocks):
        chunk = padded[i * block : (i + 1) * block]
        amax = np.max(np.abs(chunk))
        scale = np.maximum(np.float32(amax) * np.float32(1 / QMAX[kind]), TINY)  # NaN stays NaN
        q = chunk / scale
        if kind == "int8":
            q = np.nan_to_num(np.clip(np.rint(q), -127, 127)).astype(np.int8)  # an integer: no -0
        else:
            q = _round_e4m3(np.clip(q, -448, 448))
        out[i * block : (i + 1) * block] = q.astype(np.float32) * scale
        scales[i] = scale
    return out[:n], scales


def _bits(t: np.ndarray) -> np.ndarray:
    """Bit patterns, every NaN alike (a NaN must stay a NaN, whatever its payload)."""
    t = np.where(np.isnan(t), np.float32(np.nan), t).astype(np.float32)
    return t.view(np.int32)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "sizes,block", [((1,), 16), ((15,), 16), ((128,), 128), ((300,), 128), ((1000,), 64), ((5, 130, 0, 7, 256, 64), 64), ((32, 64), 32)]
)
def test_blockwise_matches_reference_bit_for_bit(kind: str, dtype: torch.dtype, sizes: tuple[int, ...], block: int) -> None:
    n = sum(sizes)
    g = torch.Generator().manual_seed(n * 7 + block)
    x = (torch.randn(3, n, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, 3, dtype=torch.float64)[:, None]).to(dtype)
    if n >= 64:
        x[1, :16] = 0  # a block of zeros
        x[2, 20] = float("nan")  # a NaN: its whole block reads back NaN
        x[0, 40] = 1e-39  # a float32 subnormal
    spec = BlockQuantization(kind, block)
    rows = RowLayout.of(spec, sizes)
    packed = torch.zeros(3, rows.nbytes, dtype=torch.uint8)
    quantize_rows(x, spec, rows, packed)
    got = torch.empty(3, n, dtype=torch.float32)
    dequantize_into(packed, spec, rows, got)
    for r in range(3):
        want, want_scales = reference(x[r], kind, block, sizes)
        assert np.array_equal(_bits(got[r].numpy()), _bits(want)), (kind, dtype, sizes, block, r)
        scales = packed[r, rows.scale_offset : rows.scale_offset + 4 * rows.blocks].view(torch.float32).numpy()
        assert np.array_equal(_bits(scales), _bits(want_scales))
    if n >= 64:
        first = min(sizes[0], block) if sizes[0] > 20 else None  # the NaN's block, when it is the first
        if first is not None:
            assert torch.isnan(got[2, :first]).all() and not torch.isnan(got[2, first:]).any()


def test_quantization_error_is_what_the_scheme_promises() -> None:
    """int8 rounds to half a step of ``amax / 127``; e4m3 to 2**-4 relative (above the
    subnormals) - the scale of what training sees."""
    x = torch.randn(4, 4096, dtype=torch.float64)
    for kind, bound in (("int8", lambda a, v: a / 127 / 2), ("fp8", lambda a, v: v.abs() * 2**-4 + a / 448 * 2**-9)):
        spec = BlockQuantization(kind, 128)
        rows = RowLayout.of(spec, (4096,))
        packed = torch.empty(4, rows.nbytes, dtype=torch.uint8)
        quantize_rows(x, spec, rows, packed)
        got = torch.empty_like(x)
        dequantize_into(packed, spec, rows, got)
        amax = x.view(4, 32, 128).abs().amax(-1, keepdim=True).expand(4, 32, 128).reshape(4, 4096)
        # Plus float32's own rounding of the values and of ``q * scale``.
        assert ((got - x).abs() <= bound(amax, x) + 1e-6 * amax).all(), kind


def test_policy_fields_and_errors() -> None:
    mp = fsdp2.MixedPrecisionPolicy(quantize_gather="int8", quantize_reduce=torch.float8_e4m3fn)
    assert mp.quantize_gather == fsdp2.BlockQuantization(torch.int8, 128)
    assert mp.quantize_reduce == fsdp2.BlockQuantization("fp8")
    assert fsdp2.MixedPrecisionPolicy().quantize_gather is None
    with pytest.raises(ValueError, match="quantize_gather expects None, 'int8', 'fp8'"):
        fsdp2.MixedPrecisionPolicy(quantize_gather="int4")
    with pytest.raises(ValueError, match="quantize_reduce expects"):
        fsdp2.MixedPrecisionPolicy(quantize_reduce=torch.float16)
    for bad in (100, 0, 8, 48, 1 << 17):  # powers of two only: the fused kernels' blocks are
        with pytest.raises(ValueError, match="power of two from 16 to 65536"):
            fsdp2.BlockQuantization("int8", bad)
    with pytest.raises(TypeError, match="block_size must be an int"):
        fsdp2.BlockQuantization("int8", 128.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="torch.int8"):
        fsdp2.BlockQuantization(torch.float8_e5m2)
    with pytest.raises(TypeError):  # keyword only: torch's four positional fields stay as they are
        fsdp2.MixedPrecisionPolicy(None, None, None, True, "int8")  # type: ignore[misc]
    # torch's own policy is still taken field by field (it has no quantization).
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    from fsdp2._validate import _from_torch

    ours = _from_torch(TorchMP(param_dtype=torch.bfloat16), (fsdp2.MixedPrecisionPolicy,))
    assert ours == fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)


# --------------------------------------------------------------------- 2 ranks
class Probe(nn.Module):
    """Parameters of uneven sizes whose local gradient is whatever the caller passes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(37, 29, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(29, dtype=torch.float64))
        self.s = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))  # a replicated scalar

    def forward(self, cw: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return (self.w * cw).sum() + (self.b * cb).sum() + self.s * cb.sum()


def _grads_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(37, 29, generator=g, dtype=torch.float64) * 3, torch.randn(29, generator=g, dtype=torch.float64)


def _bucket(module: nn.Module) -> Any:
    (bucket,) = module._fsdp2_state.group.buckets
    return bucket


def _gathered_equal_dequantized(rank: int, world: int, kind: str) -> bool:
    torch.manual_seed(0)
    model = Probe()
    fsdp2.fully_shard(model, mp_policy=fsdp2.MixedPrecisionPolicy(quantize_gather=BlockQuantization(kind, 16)))
    b = _bucket(model)
    shards = [torch.empty_like(b.sharded_flat) for _ in range(world)]
    dist.all_gather(shards, b.sharded_flat)  # every rank's full-precision sharded flat
    sizes = tuple(p.shard_numel for p in b.sharded_params)
    expected = torch.stack([torch.from_numpy(reference(s[: b.shard_numel], kind, 16, sizes)[0]) for s in shards])
    model.unshard()
    ok = all(
        torch.equal(region, expected[:, p.offset : p.offset + p.shard_numel].to(region.dtype))
        for p, region in zip(b.sharded_params, b.regions)
    )
    ok &= torch.equal(model.s.detach(), torch.tensor(0.5, dtype=torch.float64))  # scalars travel exactly
    model.reshard()
    return ok


def _reduced_equal_reference(rank: int, world: int, kind: str, poisoned: bool = False) -> bool:
    """``poisoned``: float32 parameters reduced in float64 (each gradient deposited on its
    own, leaving the padding past the uneven shards as the pool left it), the pool full of
    NaN beforehand: the padding must not leak into a block."""
    torch.manual_seed(0)
    model = Probe() if not poisoned else Probe().float()
    spec = BlockQuantization(kind, 16)
    mp = fsdp2.MixedPrecisionPolicy(reduce_dtype=torch.float64 if poisoned else None, quantize_reduce=spec)
    fsdp2.fully_shard(model, mp_policy=mp)
    dtype = torch.float32 if poisoned else torch.float64
    cw, cb = (c.to(dtype) for c in _grads_of(rank))
    loss = model(cw, cb)
    b = _bucket(model)
    if poisoned:  # every idle buffer full of NaN bytes: the reduce input is one of them
        b.comm.pool.release(b.comm.pool.acquire(4 * b.comm_numel(), torch.float64, b.device))
        for raw in [r for free in b.comm.pool._free.values() for r in free]:
            raw.fill_(255)
    loss.backward()
    layout = b.reduce.layout()
    # Rank s's reduce input row for this rank: each parameter's rows of this rank, padded.
    rows = []
    for s in range(world):
        full_w, full_b = (c.to(dtype) for c in _grads_of(s))
        parts = []
        for p in layout.params:
            full = {"w": full_w, "b": full_b}[p.fqn]
            chunk = full.chunk(world)[rank].reshape(-1) if rank < len(full.chunk(world)) else full.new_zeros(0)
            parts.append(torch.cat([chunk, chunk.new_zeros(p.shard_numel - chunk.numel())]))
        sizes = tuple(p.shard_numel for p in layout.params)
        rows.append(torch.from_numpy(reference(torch.cat(parts), kind, 16, sizes)[0]))
    total = rows[0].clone()
    for row in rows[1:]:
        total += row  # float32, rank order
    expected = (total.to(torch.float64) / world).to(dtype)
    got = torch.cat([model.w.grad._local_tensor.reshape(-1), model.b.grad._local_tensor.reshape(-1)])
    want = torch.cat([expected[off : off + p.layout.local_numel] for p, off in zip(layout.params, layout.offsets)])
    # The scalar's gradient travels exactly, in the tail: summed in the reduce dtype.
    scalar = sum(c.to(dtype).sum().to(torch.float64) for c in (_grads_of(s)[1] for s in range(world))) / world
    return torch.equal(got, want) and torch.equal(model.s.grad._local_tensor, scalar.to(dtype).reshape(()))


def _bytes(rank: int, world: int, qg: Any, qr: Any, param_dtype: Any = None) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype, quantize_gather=qg, quantize_reduce=qr)
    for layer in model:
        fsdp2.fully_shard(layer, mp_policy=mp)
    fsdp2.fully_shard(model, mp_policy=mp)
    x = torch.randn(4, 256)
    model(x).sum().backward()  # lazy init outside the count
    with CommCounter().active() as counter:
        model(x).sum().backward()
    return dict(counter.bytes)


def _world_one(rank: int, world: int) -> bool:
    """One rank: nothing travels, nothing is quantized: bitwise the unquantized run."""
    out = []
    for mp in (fsdp2.MixedPrecisionPolicy(), fsdp2.MixedPrecisionPolicy(quantize_gather="int8", quantize_reduce="fp8")):
        torch.manual_seed(0)
        model = Probe()
        fsdp2.fully_shard(model, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with CommCounter().active() as counter:
            for _ in range(2):
                model(*_grads_of(0)).backward()
                opt.step()
        out.append(([p.detach().full_tensor().clone() for p in model.parameters()], sum(counter.calls.values())))
    (a, calls_a), (b, calls_b) = out
    return all(torch.equal(x, y) for x, y in zip(a, b)) and calls_a == calls_b == 0


def _custom_collective_refused(rank: int, world: int) -> str:
    model = fsdp2.fully_shard(nn.Linear(8, 8), mp_policy=fsdp2.MixedPrecisionPolicy(quantize_gather="int8"))

    class Comm:
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("not called")

    try:
        model.set_custom_all_gather(Comm())
    except ValueError as e:
        assert model._fsdp2_state.group.buckets[0].user.all_gather is None  # nothing changed
        model.set_custom_reduce_scatter(Comm())  # the reduce is not quantized: allowed
        return str(e)
    return ""


@cached_outcome
def _two_ranks() -> dict[str, list[Any]]:
    scenarios: dict[str, tuple[Any, tuple]] = {}
    for kind in ("int8", "fp8"):
        scenarios[f"gather_{kind}"] = (_gathered_equal_dequantized, (kind,))
        scenarios[f"reduce_{kind}"] = (_reduced_equal_reference, (kind,))
        scenarios[f"reduce_{kind}_poisoned"] = (_reduced_equal_reference, (kind, True))
    scenarios["bytes_fp32"] = (_bytes, (None, None))
    scenarios["bytes_bf16"] = (_bytes, (None, None, torch.bfloat16))
    scenarios["bytes_int8"] = (_bytes, ("int8", "int8"))
    scenarios["bytes_int8_bf16"] = (_bytes, ("int8", None, torch.bfloat16))
    scenarios["custom"] = (_custom_collective_refused, ())
    return run_scenarios(2, scenarios)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gathered_parameters_are_every_ranks_dequantized_shards(kind: str) -> None:
    assert _two_ranks()[f"gather_{kind}"] == [True, True]


@pytest.mark.parametrize("kind", ["int8", "fp8", "int8_poisoned", "fp8_poisoned"])
def test_reduced_gradients_are_the_rank_ordered_sum_of_dequantized_rows(kind: str) -> None:
    assert _two_ranks()[f"reduce_{kind}"] == [True, True]


def test_bytes_on_the_wire() -> None:
    r = _two_ranks()
    fp32, bf16, int8, int8_bf16 = (r[k][0] for k in ("bytes_fp32", "bytes_bf16", "bytes_int8", "bytes_int8_bf16"))
    assert int8["all_gather"] <= 0.27 * fp32["all_gather"], (int8, fp32)
    assert int8_bf16["all_gather"] <= 0.53 * bf16["all_gather"], (int8_bf16, bf16)
    assert int8["reduce"] <= 0.27 * fp32["reduce"], (int8, fp32)
    assert int8_bf16["reduce"] == bf16["reduce"]  # the reduce not quantized: unchanged


def test_a_custom_collective_on_a_quantized_payload_is_refused() -> None:
    msg = _two_ranks()["custom"][0]
    assert "quantizes its gather" in msg and "Drop quantize_gather" in msg


def test_world_size_one_does_not_quantize() -> None:
    assert run_ranks(_world_one, 1) == [True]


# --------------------------------------------------------------------- composition, 2 and 4 ranks
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 48)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 48)) for _ in range(2))
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _mesh(cfg: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if cfg == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    if cfg == "tp":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,))


def _parallelize(cfg: str, model: Net, mesh: Any, world: int) -> tuple[dict[str, Any], int, int]:
    """The fully_shard keywords of ``cfg`` beyond the policy, and this rank's data shard."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank()
    if cfg == "tp":  # each block's MLP colwise / rowwise over tp, then sharded over dp
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return {"mesh": mesh["dp"]}, rank // 2, world // 2
    if cfg == "per_param":  # the blocks' second matrices over an HSDP mesh of their own
        from torch.distributed.device_mesh import init_device_mesh

        hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        second = {id(p) for b in model.blocks for p in b[2].parameters()}

        def place(p: nn.Parameter) -> Any:
            return fsdp2.ShardPlacementResult(Shard(0), hsdp) if id(p) in second else None

        return {"mesh": mesh, "shard_placement_fn": place}, rank, world
    if cfg == "compile":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    return {"mesh": mesh}, rank, world


def _train(
    rank: int, world: int, cfg: str, qg: Any, qr: Any, ckpt: str | None = None, steps: int = 3
) -> dict[str, Any]:
    """Three steps of ``Net`` under ``cfg``; losses, final full parameters, state-dict
    shape, the quantized buffers the estimate's tracker sees."""
    torch.manual_seed(0)
    model = Net().double()
    mesh = _mesh(cfg, world)
    mp_kw: dict[str, Any] = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if cfg == "bf16" else {}
    if cfg == "bf16":
        model = model.float()
    mp = fsdp2.MixedPrecisionPolicy(quantize_gather=qg, quantize_reduce=qr, **mp_kw)
    kw, data_rank, data_ranks = _parallelize(cfg, model, mesh, world)
    kw["mp_policy"] = mp
    if cfg == "offload":
        kw["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    if cfg == "ac":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    for block in model.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=2 if cfg == "reshard2" else True, **kw)
    fsdp2.fully_shard(model, **kw)
    if cfg == "muon":
        from fsdp2.optim import Muon

        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        opts = [Muon(matrices, lr=0.02), torch.optim.SGD(others, lr=0.1)]
    else:  # not Adam: it would blow gradients near 0 (of either sign after quantizing) up to lr
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(8 * world, 16, generator=g, dtype=torch.float64)
        y = torch.randn(8 * world, 4, generator=g, dtype=torch.float64)
        xr, yr = x.chunk(data_ranks)[data_rank], y.chunk(data_ranks)[data_rank]  # a tp pair shares its rows
        dtype = torch.float32 if cfg == "bf16" else torch.float64
        loss = (model(xr.to(dtype)).double() - yr).square().mean()
        loss.backward()
        if cfg == "clip":
            fsdp2.clip_grad_norm_(model.parameters(), 0.5)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    sd = model.state_dict()
    if ckpt is not None:  # DCP: saved by the quantized model, loaded into an unquantized one
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=f"{ckpt}/{cfg}-{qg}-{qr}")
        fresh = _train(rank, world, cfg, None, None, None, steps=0)["model"]
        loaded = fresh.state_dict()
        dcp.load(loaded, checkpoint_id=f"{ckpt}/{cfg}-{qg}-{qr}")
        differ = [k for k, v in sd.items() if not torch.equal(loaded[k].full_tensor(), v.full_tensor())]
        if differ:
            raise AssertionError(f"a DCP checkpoint of the quantized model did not load back bitwise: {differ}")
    if steps == 0:
        return {"model": model}
    return {
        "losses": losses,
        "params": {n: p.detach().full_tensor().double() for n, p in model.named_parameters()},
        "state_dict": {k: (type(v).__name__, v.dtype, tuple(v.shape)) for k, v in sd.items()},
    }


CONFIGS = ["plain", "hsdp", "bf16", "reshard2", "offload", "ac", "clip", "muon", "tp", "per_param", "compile"]


# At 4 ranks what needs them: a 2-D mesh (HSDP, dp x tp, the blocks' own HSDP mesh) or a
# partial reshard (to 2 of the 4 ranks); the rest at 2 ranks, where 4 take no other path.
FOUR_RANKS = ("hsdp", "reshard2", "tp", "per_param")


@cached_outcome
def _composition(world: int) -> dict[str, list[Any]]:
    ckpt = tempfile.mkdtemp(prefix="fsdp2-quant-")
    scenarios: dict[str, tuple[Any, tuple]] = {}
    for cfg in CONFIGS:
        if (cfg in FOUR_RANKS) != (world == 4):
            continue
        dcp = ckpt if cfg in ("plain", "hsdp", "tp") else None
        scenarios[f"{cfg}/none"] = (_train, (cfg, None, None))
        scenarios[f"{cfg}/int8"] = (_train, (cfg, BlockQuantization("int8", 32), "int8", dcp))
        scenarios[f"{cfg}/fp8"] = (_train, (cfg, "fp8", BlockQuantization("fp8", 32), dcp))
    try:
        return run_scenarios(world, scenarios)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_composes_within_the_quantization_error(cfg: str, kind: str) -> None:
    runs = _composition(4 if cfg in FOUR_RANKS else 2)
    base, quant = runs[f"{cfg}/none"][0], runs[f"{cfg}/{kind}"][0]
    tol = 0.02 if kind == "int8" else 0.08
    for a, b in zip(base["losses"], quant["losses"]):
        assert math.isfinite(b) and abs(a - b) <= tol * abs(a), (cfg, kind, base["losses"], quant["losses"])
    for name, p in base["params"].items():
        q = quant["params"][name]
        assert torch.isfinite(q).all(), name
        # Not for Muon: orthogonalizing lifts a gradient's small singular directions,
        # quantization noise included, to the step size (its losses are compared above).
        if cfg != "muon":
            assert (q - p).abs().max() <= tol * max(p.abs().max().item(), 1e-3) + 5e-3, (cfg, kind, name)
    assert quant["state_dict"] == base["state_dict"]  # checkpoints unchanged: same keys, types, dtypes
    assert quant["losses"] != base["losses"]  # it did quantize
    # Every rank holds the same parameters (HSDP replicas included).
    for other in runs[f"{cfg}/{kind}"][1:]:
        assert all(torch.equal(other["params"][n], q) for n, q in quant["params"].items())


def test_copy_of_a_quantized_policy_is_equal() -> None:
    mp = fsdp2.MixedPrecisionPolicy(quantize_gather="fp8")
    assert copy.deepcopy(mp) == mp and hash(mp) == hash(copy.deepcopy(mp))

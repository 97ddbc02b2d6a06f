"""``CPUOffloadPolicy`` on an accelerator mesh: where a bucket's tensors live.

The sharded flat buffer (so the sharded parameters, their gradients and the optimizer
state made from them) lives on the host; the all-gather's input, the unsharded
parameters and the reduce run on the compute device. Per step, per bucket:

* unshard: the shards are copied host -> device (``to_compute``), then cast to the
  compute dtype there and gathered; when the gather finishes the CPU waits for that copy
  (``wait_copied_in``), so nothing can write the host shards while it still reads them;
* reduce: this rank's reduced row is cast to the parameters' dtype and divided on the
  device, then copied device -> host (``to_host``); with pinned memory the copies are
  asynchronous,
  and ``wait_host`` (before the gradients are read on the host, at commit) blocks the
  CPU until they landed.

On a CPU mesh the policy costs nothing: there is no ``HostOffload`` (None), as
everything already lives on the host.
"""

from __future__ import annotations

import torch

from ..api import CPUOffloadPolicy, OffloadPolicy


class HostOffload:
    """One bucket's host copies: shards on ``host``, gathers and reduces on ``compute``."""

    def __init__(self, compute: torch.device, pin_memory: bool, host: torch.device | None = None) -> None:
        self.compute = compute
        self.host = torch.device("cpu") if host is None else host
        self.pin_memory = pin_memory
        self._copied: torch.Event | None = None  # an event after the last device -> host copy (pinned)
        self._read: torch.Event | None = None  # an event after the last host -> device copy (pinned)

    @classmethod
    def for_policy(cls, policy: OffloadPolicy | None, device: torch.device) -> HostOffload | None:
        """The offload of a ``CPUOffloadPolicy`` on ``device``'s mesh; None without one
        or where the mesh's device is the host already (CPU) or has no memory (meta)."""
        if not isinstance(policy, CPUOffloadPolicy) or device.type in ("cpu", "meta"):
            return None
        return cls(device, bool(policy.pin_memory))

    def home(self, device: torch.device) -> torch.device:
        """Where shards go that would otherwise live on ``device`` (meta stays meta)."""
        return device if device.type == "meta" else self.host

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for shards (pinned, if asked: device copies then run async)."""
        return torch.zeros(numel, dtype=dtype, device=self.host, pin_memory=self.pin_memory)

    def to_compute(self, shard: torch.Tensor) -> torch.Tensor:
        """The shards on the compute device (host -> device; async from pinned memory:
        the stream orders the gather after it; ``wait_copied_in`` before the host
        shards may change)."""
        with torch.profiler.record_function("fsdp2::offload_h2d"):
            out = shard.to(self.compute, non_blocking=self.pin_memory, copy=True)
        self._mark_read()
        return out

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (on the device) from host ``src``, as ``to_compute``."""
        dst.copy_(src, non_blocking=self.pin_memory)
        self._mark_read()

    def _mark_read(self) -> None:
        if self.pin_memory and self.compute.type != "cpu":
            self._read = torch.Event(device=self.compute)
            self._read.record()

    def wait_copied_in(self) -> None:
        """Block the CPU until the host -> device copies issued so far landed: after
        this the host shards may change (an optimizer step, a load, user code) without
        racing a copy still reading them. Called when the gather finishes."""
        read, self._read = self._read, None
        if read is not None:
            read.synchronize()

    def to_host(self, result: torch.Tensor) -> torch.Tensor:
        """A host copy of ``result`` (device -> host; async into pinned memory: see
        ``wait_host``)."""
        with torch.profiler.record_function("fsdp2::offload_d2h"):
            out = torch.empty(result.shape, dtype=result.dtype, device=self.host, pin_memory=self.pin_memory)
            out.copy_(result, non_blocking=self.pin_memory)
            if self.pin_memory and self.compute.type != "cpu":
                self._copied = torch.Event(device=self.compute)
                self._copied.record()
        return out

    def wait_host(self) -> None:
        """Block the CPU until the last ``to_host`` copy landed (before reading it)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            copied.synchronize()

"""Peak GPU memory per phase of a step, fsdp2 against torch's fully_shard and a local model.

    python tools/gpu_memory.py [--steps 3]

Each library runs in a process of its own (one GPU, world size 1, NCCL), so nothing one
leaves behind (cuBLAS's workspaces, a model awaiting garbage collection) counts against
another: gpu_check.py's model with AdamW, in float32 and with a bf16
``MixedPrecisionPolicy``. Per step it prints ``max_memory_allocated`` (MiB, above what
was allocated before the model was built) of the forward, of the backward, what is still
allocated after backward, the optimizer step's peak and what is allocated after the
step. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
LIBS = ("fsdp2", "torch", "local")


def _one(lib_name: str, steps: int) -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "examples")]
    import gpu_check as g

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    lib = {"fsdp2": fsdp2, "torch": torch_fsdp, "local": None}[lib_name]
    device = torch.device("cuda", 0)
    g._warm_up(device)
    for mixed in (False,) if lib is None else (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, _ = g._build(lib, device, mixed, False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        rows = []
        for _ in range(steps):
            tokens = torch.randint(0, g.ARGS.vocab_size, (g.BATCH, g.SEQ + 1), generator=gen).to(device)
            row = []
            torch.cuda.reset_peak_memory_stats()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            row.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            del logits, loss
            row += [torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()]
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            row.append(torch.cuda.max_memory_allocated())
            opt.zero_grad(set_to_none=True)
            row.append(torch.cuda.memory_allocated())
            rows.append(" ".join(f"{(x - base) / MIB:7.1f}" for x in row))
        mode = "bf16" if mixed else "fp32"
        print(f"| {lib_name} | {mode} | " + " | ".join(rows) + " |", flush=True)
        del model, opt
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lib", choices=LIBS, help=argparse.SUPPRESS)  # the per-library process
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory: no CUDA device here; nothing to measure")
        return 0
    if args.lib:
        _one(args.lib, args.steps)
        return 0
    print(f"per step: forward peak, backward peak, after backward, optimizer peak, after the step (MiB); "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| library | mode | " + " | ".join(f"step {i + 1}" for i in range(args.steps)) + " |")
    print("| --- | --- |" + " --- |" * args.steps)
    for port, lib in enumerate(LIBS, start=29611):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0")
        done = subprocess.run([sys.executable, __file__, "--lib", lib, "--steps", str(args.steps)], env=env,
                              timeout=300, check=False)
        if done.returncode:
            print(f"| {lib} | failed (exit code {done.returncode}) |")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

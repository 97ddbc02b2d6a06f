#!/usr/bin/env bash
# Every GPU check in one call, for a session lent a GPU machine for a few minutes:
#   bash tools/gpu_session.sh [OUTDIR]
# Each step has its own time limit and writes its output to OUTDIR (default: gpu_out);
# a failing step does not stop the next; ONLY="check estimate" runs those steps alone.
# Runs with the machine's python3 and torch.
set -u
out=${1:-${OUT:-gpu_out}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "rc $?" >>"$out/$name.txt"
    tail -n 40 "$out/$name.txt"
}
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
$py -c "import torch, fsdp2; print('torch', torch.__version__, 'cuda', torch.version.cuda,
         torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" || exit 1
step check 240 $py tools/gpu_check.py
step quant 150 $py tools/gpu_check.py --quant
step gloo2 150 $py tools/gpu_check.py --gloo-world 2 --hang-seconds 60
step memory 180 $py tools/gpu_memory.py
step deposit 60 $py tools/bench_deposit.py --world 8 --dim 4096
args="examples/train.py --steps 3 --dim 1024 --layers 8 --heads 8 --vocab 8192 --seq-len 512 --batch-size 4"
step estimate 120 $py -m fsdp2.estimate --nproc-per-node 1 -- $args
step measure 120 $py -m torch.distributed.run --nproc-per-node 1 -m fsdp2.estimate --measure -- $args
step train_fsdp2 90 $py -m torch.distributed.run --nproc-per-node 1 examples/train.py --steps 20 --bf16 --dim 1024 --layers 8 --heads 8 --vocab 8192 --seq-len 512
step train_torch 90 $py -m torch.distributed.run --nproc-per-node 1 examples/train.py --steps 20 --bf16 --dim 1024 --layers 8 --heads 8 --vocab 8192 --seq-len 512 --impl torch
# Weights out, memory back: device moves between RL phases; the device's allocated bytes after model.cpu()
rl="examples/rl_loop.py --iterations 3 --dim 1024 --layers 8 --heads 8 --vocab 8192"
step rl_fsdp2 120 $py -m torch.distributed.run --nproc-per-node 1 $rl
step rl_torch 120 $py -m torch.distributed.run --nproc-per-node 1 $rl --impl torch

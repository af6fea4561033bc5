"""Train a zoo model with torch.distributed.pipelining from a `partitioner export --to torch-pipelining` file.

    torchrun --nproc-per-node 4 examples/torch_pipelining_train.py out/vgg19t.torch.json --steps 5

One process per rank of the export (gloo on CPU, NCCL with --device cuda). Synthetic batches
come from the zoo model's input maker (runtime.data), so every rank sees the same global batch
and each pipeline trains on its own rows; the loss is the runtime's (mean of the output).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from runtime.data import SyntheticData
from runtime.stage import zoo_chain
from runtime.torch_pipelining import build_rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="torch-pipelining export JSON")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    with open(args.export, encoding="utf-8") as f:
        export = json.load(f)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        me = build_rank(export, rank, seed=args.seed, device=device)
        opt = torch.optim.SGD(list(me.parameters()), lr=args.lr)
        chain = zoo_chain(export["model"], export["micro_batch_size"])
        data = SyntheticData(chain.make_input, export["micro_batch_size"], export["n_microbatches"],
                             len(export["pipelines"]), args.seed)
        for step in range(args.steps):
            losses = me.step(data.global_batch(step)[0].to(device))
            me.sync_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if losses is not None:
                print(f"rank {rank} (pipeline {me.worker}) step {step}: loss {sum(losses) / len(losses):.6g}",
                      flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

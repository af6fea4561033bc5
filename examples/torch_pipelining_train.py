"""Train a zoo model with torch.distributed.pipelining from a `partitioner export --to torch-pipelining` file.

    torchrun --nproc-per-node 4 examples/torch_pipelining_train.py out/vgg19t.torch.json --steps 5

Across machines, run the export's launch lines (`launch.torchrun`: node k with --node-rank k and
CUDA_VISIBLE_DEVICES in its ranks' order): each process takes its rank from its node and local rank
(runtime.torch_pipelining.export_seat), so the plan's stage -> GPU mapping holds whatever torchrun's
RANK. One process per rank of the export (gloo on CPU, NCCL with --device cuda). The data is the
model's own task (runtime.data: text for GPT-2 and BERT, a classification task for CNNs; every rank
makes the same global batch and each pipeline trains on its own rows) and the loss its cross-entropy;
the precision and the optimizer are the plan's (the export's `training`; --optimizer, --lr override).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from runtime.data import make_data
from runtime.model import is_model_ref, spec_chain
from runtime.stage import zoo_chain
from runtime.torch_pipelining import build_rank, export_seat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="torch-pipelining export JSON")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                    help="default: the export's (the plan's pricing)")
    ap.add_argument("--lr", type=float, default=None, help="default: the export's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", choices=("auto", "synthetic"), default="auto",
                    help="auto: the model's task (cross-entropy); synthetic: random inputs, loss = mean output")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    with open(args.export, encoding="utf-8") as f:
        export = json.load(f)
    rank, local = export_seat(export)  # from the node (--node-rank) and LOCAL_RANK, not torchrun's RANK
    device = torch.device(f"cuda:{local}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["RANK"] = str(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=export["world_size"])
    try:
        model = export["model"]
        chain = spec_chain(model) if is_model_ref(model) else zoo_chain(model, export["micro_batch_size"])
        data = make_data(chain, args.data, export["micro_batch_size"], export["n_microbatches"],
                         len(export["pipelines"]), args.seed)
        me = build_rank(export, rank, seed=args.seed, device=device, loss_fn=data.loss)
        training = export["training"]
        name = args.optimizer or training["optimizer"]
        lr = args.lr if args.lr is not None else training["lr"]
        opt = me.make_optimizer(name, lr)
        if rank == 0:
            print(f"{model}: {name} (lr {lr:g}) in {training['precision']}, data {data.kind}", flush=True)
        for step in range(args.steps):
            x, y = data.global_batch(step)
            losses = me.step(x, y)
            me.sync_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if losses is not None and me.tp_rank == 0:  # (a tensor-parallel group: the same losses)
                print(f"rank {rank} (pipeline {me.worker}) step {step}: loss {sum(losses) / len(losses):.6g}",
                      flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

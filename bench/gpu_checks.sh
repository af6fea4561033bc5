#!/usr/bin/env bash
# The CUDA checks behind docs/gpu.md, on one GPU: the gpu tests, per-layer profiles of an
# OPT-350M-shaped model in fp16 (for the comparison with Sailor's measured profiles,
# bench/sailor_profiles.py), and one training run whose iteration and peak memory are printed
# beside the simulator's and the cost model's.
#     bash bench/gpu_checks.sh OUT_DIR [GPU_TYPE]      (GPU_TYPE: a catalog name, default H100-SXM5-80GB)
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT_DIR [GPU_TYPE]}
gpu=${2:-H100-SXM5-80GB}
py=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
$py -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log"
for b in 1 2 4 8; do
  $py -m partitioner_cli profile gpt2-medium --batch-size "$b" --seq-len 2048 --vocab 50272 --dtype float16 \
      --device cuda --gpu-type "$gpu" -o "$out/opt350_fp16_b$b.json"
done
$py -m partitioner_cli profile gpt2-small --batch-size 4 --seq-len 512 --device cuda --gpu-type "$gpu" \
    -o "$out/gpt2s_fp32_b4.json"
for s in gpipe 1f1b; do
  $py -m partitioner_cli plan "$out/gpt2s_fp32_b4.json" --cluster examples/clusters/h100x1.yaml --solver dp \
      --schedule "$s" --microbatches 4 -o "$out/plan_$s.json" > /dev/null
  $py -m partitioner_cli train "$out/plan_$s.json" --profile "$out/gpt2s_fp32_b4.json" \
      --cluster examples/clusters/h100x1.yaml --model gpt2-small --local --device cuda --steps 30 --warmup 5 \
      --data text -o "$out/train_$s.json" 2>&1 | tee "$out/train_$s.txt"
done

#!/usr/bin/env bash
# The CUDA checks behind docs/gpu.md, on one GPU, in the order of what only a GPU can show:
#   1. per-layer profiles of an OPT-350M-shaped model in fp16 at micro-batch 1, 2, 4, 8, each with
#      one GPU's shard of every block at tensor-parallel 2, 4 and 8 (bench/sailor_profiles.py and
#      bench/gpu_projection.py compare them with Sailor's measured profiles and the projection);
#   2. GPT-2 small profiles (fp32 and bf16) and training runs as planned: fp32 and bf16 mixed
#      precision, Adam as priced, activation recomputation none/selective/full; each run's
#      iteration time and peak memory are printed beside the simulator's and the cost model's;
#   3. the gpu tests (tests/test_gpu.py).
#     bash bench/gpu_checks.sh OUT_DIR [GPU_TYPE]      (GPU_TYPE: a catalog name, default H100-SXM5-80GB)
# SMALL=1 runs the same commands with tiny shapes on the CPU (a check of the script itself).
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT_DIR [GPU_TYPE]}
gpu=${2:-H100-SXM5-80GB}
py=${PYTHON:-python3}
cli="$py -m partitioner_cli"
mkdir -p "$out"
if [ "${SMALL:-0}" = 1 ]; then
  dev=cpu; big=gpt2-tiny; big_seq=64; big_vocab=512; small=gpt2-tiny; seq=64; sizes="1 2"; tp=2
  cluster=examples/clusters/h100x1.yaml
else
  dev=cuda; big=gpt2-medium; big_seq=2048; big_vocab=50272; small=gpt2-small; seq=512; sizes="1 2 4 8"
  tp=2,4,8; cluster=examples/clusters/h100x1.yaml
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
step() { echo "== $(date +%T) $*" | tee -a "$out/steps.log"; }

for b in $sizes; do
  step "profile $big fp16 b=$b tp=$tp"
  timeout 120 $cli profile $big --micro-batch-size "$b" --seq-len $big_seq --vocab $big_vocab --dtype float16 \
      --device $dev --gpu-type "$gpu" --tensor-parallel $tp -q -o "$out/opt350_fp16_b$b.json"
done
for dtype in float32 bfloat16; do
  step "profile $small $dtype"
  timeout 90 $cli profile $small --micro-batch-size 4 --seq-len $seq --dtype $dtype --device $dev \
      --gpu-type "$gpu" -q -o "$out/gpt2s_${dtype}_b4.json"
done

# name schedule precision recompute profile
runs="fp32_gpipe gpipe fp32 none float32
fp32_1f1b 1f1b fp32 none float32
bf16_1f1b 1f1b bf16 none bfloat16
bf16_1f1b_selective 1f1b bf16 selective bfloat16
bf16_1f1b_full 1f1b bf16 full bfloat16"
while read -r name sched prec rc dtype; do
  step "train $name"
  prof="$out/gpt2s_${dtype}_b4.json"
  $cli plan "$prof" --cluster $cluster --solver dp --schedule "$sched" --micro-batches 4 \
      --precision "$prec" --recompute "$rc" -q -o "$out/plan_$name.json" > /dev/null || continue
  timeout 150 $cli train "$out/plan_$name.json" --profile "$prof" --cluster $cluster --model $small \
      --local --device $dev --steps 20 --warmup 5 --data text -o "$out/train_$name.json" 2>&1 \
      | tee "$out/train_$name.txt"
done <<< "$runs"

if [ "$dev" = cuda ]; then
  step "gpu tests"
  timeout 240 $py -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log"
fi
step done

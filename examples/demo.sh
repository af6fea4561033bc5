#!/usr/bin/env bash
# The main job on built-in examples: import a real profile, plan it, print the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-out}
mkdir -p "$OUT"

echo "== 1. import a real per-layer profile (PipeDream, VGG-16 on a V100, minibatch 128)"
$PY -m partitioner import pipedream examples/profiles/vgg16_pipedream_graph.txt \
    --gpu-type V100-SXM2-16GB --model vgg16 -o "$OUT/vgg16.json"

echo
echo "== 2. plan it on one 8 x V100 node (exact DP, 1F1B, memory-checked)"
$PY -m partitioner plan "$OUT/vgg16.json" --cluster examples/clusters/v100x8.yaml \
    --micro-batches 16 --allow-fewer -o "$OUT/vgg16_plan.json"

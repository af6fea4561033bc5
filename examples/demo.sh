#!/usr/bin/env bash
# The main job on built-in examples: import or profile -> plan -> simulate, on one node of
# identical GPUs and on the heterogeneous HetPipe cluster. Outputs go to out/ (or $OUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-out}
mkdir -p "$OUT"
run() { echo "\$ partitioner $*"; $PY -m partitioner_cli "$@"; echo; }

echo "== 1. a real per-layer profile: VGG-16 measured by PipeDream's profiler on a V100 (minibatch 128)"
run import pipedream examples/profiles/vgg16_pipedream_graph.txt --gpu-type V100-SXM2-16GB --model vgg16 \
    -o "$OUT/vgg16.json"

echo "== 2. plan it on one 8 x V100 node: exact DP, 1F1B, memory-checked"
run plan "$OUT/vgg16.json" --cluster examples/clusters/v100x8.yaml --micro-batches 16 --allow-fewer \
    -o "$OUT/vgg16_plan.json"

echo "== 3. simulate the plan: timeline, bubbles, peak memory; Perfetto trace and PNG"
run simulate "$OUT/vgg16_plan.json" --profile "$OUT/vgg16.json" --cluster examples/clusters/v100x8.yaml \
    --trace "$OUT/vgg16_trace.json" --png "$OUT/vgg16_timeline.png"

echo "== 4. profile a model of the zoo on this machine (a tiny VGG-19, CPU) and project it to GPU types"
run profile vgg19-tiny --micro-batch-size 8 --device cpu --repeats 3 -o "$OUT/vgg19_tiny_cpu.json"
run profile project "$OUT/vgg19_tiny_cpu.json" --gpu-type TITAN-V --gpu-type RTX-2060 -o "$OUT/vgg19_tiny.json"

echo "== 5. the HetPipe cluster (16 GPUs of 4 types on 4 nodes): VGG-19 at micro-batch 32, measured on a CPU"
echo "      and projected to the four types (examples/profiles/vgg19_hetpipe.json); virtual workers,"
echo "      device order and split chosen together (opt), against HetPipe's equal-distribution policy"
run plan examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml \
    --virtual-workers auto --policy opt --micro-batches 8 -o "$OUT/vgg19_hetpipe_plan.json"
run plan examples/profiles/vgg19_hetpipe.json --cluster examples/clusters/hetpipe.yaml \
    --virtual-workers auto --policy ed --micro-batches 8 -o "$OUT/vgg19_hetpipe_ed.json"

echo "== 6. train with a plan: a tiny VGG-19 profiled here at micro-batch 32 (one thread, as each training"
echo "      process will have), planned over two CPU devices,"
echo "      trained by the runtime (one process per device, gloo) and measured against the simulator"
run profile vgg19-tiny --micro-batch-size 32 --device cpu --threads 1 -o "$OUT/vgg19_tiny32.json"
run plan "$OUT/vgg19_tiny32.json" --cluster examples/clusters/cpu4.yaml --devices n0:0,n0:1 --micro-batches 4 \
    -o "$OUT/vgg19_tiny_plan.json"
run train "$OUT/vgg19_tiny_plan.json" --profile "$OUT/vgg19_tiny32.json" --cluster examples/clusters/cpu4.yaml \
    --model vgg19-tiny --local --steps 10 -o "$OUT/vgg19_tiny_metrics.json"

#!/bin/bash
# What a GPU shows that the CPU suite cannot, in one short sitting (~8 min on one H100):
#   1. tests/test_on_a_gpu.py: every seed recipe, r3 for every family, and Liger's kernels, on CUDA;
#   2. the bench on Qwen2-VL-2B's own dimensions (`demo:qwen2-vl-2b-shaped`), r1's stage, TRL against ours.
# Run from the repository root with the project's dependencies installed (pip install -e '.[dev,gpu]').
# Offline, with wheels in .whl/ (built here by benchmarks/gpu_carry/make_carry.sh from its pins.txt, the
# versions CI resolves; carry .whl): they are installed into /tmp/site first.
# Logs and the bench's JSON go to $OUT (default gpu-check/). TEST_S / BENCH_S: each part's time limit.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-check}; mkdir -p "$OUT"
T0=$(date +%s)
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD/src
fi
nvidia-smi -L
python3 -c "
import importlib.metadata as m, torch
for p in ['torch', 'transformers', 'trl', 'peft', 'bitsandbytes', 'accelerate', 'datasets', 'liger-kernel', 'av']:
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'MISSING')
print(torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/versions.txt"
echo "setup done at $(( $(date +%s) - T0 )) s"
# one process per test file is pytest.ini's CPU default (--dist loadfile): here every test is its own process
timeout "${TEST_S:-240}" python3 -m pytest tests/test_on_a_gpu.py -n 8 --dist load -q -rA -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^PASSED\|^$" | tail -40
echo "tests done at $(( $(date +%s) - T0 )) s"
timeout "${BENCH_S:-300}" python3 -m vlm_recipes bench --model demo:qwen2-vl-2b-shaped --precision bf16 \
    --scenarios first-epoch --stages "${STAGES:-llm-lora}" --without-overhead-check --repeats "${REPEATS:-1}" \
    --rows 64 --threads 8 --out "$OUT/gpu-bench-2b.json" 2>&1 | tee "$OUT/gpu-bench.log" | grep -v "it/s\]" | tail -30
echo "bench done at $(( $(date +%s) - T0 )) s"

#!/bin/bash
# A whole GPU visit in one command, ended by itself within DEADLINE_S (570 s: the run tool gives a command
# 600 s), or its rehearsal on a CPU.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine: the run tool with carry [".whl"]
#   bash benchmarks/gpu_check.sh --rehearse   # here, with the package index, before GPU time is spent
#
# Parts, each under its own time limit in seconds (override: CARRY_S, VERSIONS_S, TESTS_S, BENCH_S):
#   carry      .whl/'s wheels (benchmarks/gpu_carry/make_carry.sh, pins.txt) installed with --target over the
#              image's packages, first on PYTHONPATH; prints `carry: N MiB` (wheels and tree, <= 58)
#   versions   the device, the libraries' versions, `pip check`
#   gpu-tests  tests/test_on_a_gpu.py, one process per test
#   bench      r1's and r2's stages at Qwen2-VL-2B's shape (`demo:qwen2-vl-2b-shaped`), plain TRL against
#              ours, bf16, MFU against the matmul peak measured in the same call
# The time, in seconds. A part gets SIGINT at its limit and SIGKILL KILL_AFTER_S (20) later; then the summary
# is rewritten (SUMMARY_S, 5, allowed). After the last part come the summary's print and check (END_S, 5).
# The own limits, 45 + 45 + 290 + 200 = 580, with 4 x (20 + 5) for the kills and summaries and 5 at the end,
# could take 685 s. So each part's limit is
#   min(its own limit, DEADLINE_S - elapsed - KILL_AFTER_S - SUMMARY_S - END_S)
# with elapsed rounded up to the next second; a part left under MIN_PART_S (30) is skipped (`skipped` in the
# summary). Every part then ends by DEADLINE_S - END_S, and the visit by DEADLINE_S (570), whatever overruns.
# Worst case (each part runs to its kill, elapsed rounded up): carry 45 s ends by 71, versions 45 by 142,
# gpu-tests 290 by 458, the bench min(200, 570 - 459 - 30) = 81 by 565, the end by 570. Usually the bench
# gets its 200 s.
# The rehearsal has no deadline (DEADLINE_S=0): first it checks pins.txt against what CI resolves today
# (gpu_carry/check_pins.py on `pip install --dry-run --report` of .[dev], as .ci/run installs; a difference
# fails the part and says how to regenerate the pins), then it builds the carry and a virtual environment
# pinned to the image's versions (gpu_carry/image.txt: torch 2.11.0+cu130 from PyPI, transformers 5.17,
# accelerate 1.15); then the same carry, versions and gpu-tests parts (on a CPU every GPU test skips with its
# reason: the file collects and imports through the carried packages), and instead of the bench one r1 stage
# trained on the CPU.
# After every part $OUT/summary.md and $OUT/gpu-check.json are rewritten, so a visit cut short says how far it
# got (benchmarks' results: $OUT/bench.json, also written after each run). Exit 0 when every part ended well.
# PART_STAND_IN (tests/test_gpu_carry.py): a command run instead of every part, given the part's name as $1.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$ROOT/gpu-check}; mkdir -p "$OUT"; : > "$OUT/parts.jsonl"
SITE=${SITE:-/tmp/gpu-check-site}
REHEARSE=0; [ "${1:-}" = --rehearse ] && REHEARSE=1
IMAGE_VENV=${IMAGE_VENV:-/tmp/gpu-image-venv}
PYTHON=python3; [ $REHEARSE = 1 ] && PYTHON=$IMAGE_VENV/bin/python
export ROOT OUT SITE PYTHON
export PYTHONPATH=$SITE:$ROOT/src
SUMMARY=$ROOT/src/vlm_recipes/benchmarking/gpu_check_summary.py
if [ $REHEARSE = 1 ]; then PLANNED=pins,rehearsal-setup,carry,versions,gpu-tests,rehearsal-r1
else PLANNED=carry,versions,gpu-tests,bench; fi
DEADLINE_S=${DEADLINE_S:-$([ $REHEARSE = 1 ] && echo 0 || echo 570)}  # 0: none
KILL_AFTER_S=${KILL_AFTER_S:-20} SUMMARY_S=${SUMMARY_S:-5} END_S=${END_S:-5} MIN_PART_S=${MIN_PART_S:-30}
T0=$(date +%s)

# limit_for OWN_S: the part's limit, its own cut to what the deadline leaves (the header's arithmetic)
limit_for() {
    local own=$1 left
    [ "$DEADLINE_S" -gt 0 ] || { echo "$own"; return; }
    left=$((DEADLINE_S - ($(date +%s) - T0 + 1) - KILL_AFTER_S - SUMMARY_S - END_S))
    echo $((own < left ? own : left))
}

# the part's own function, or PART_STAND_IN in its place (the scheduling's test)
body_of() {
    if [ -n "${PART_STAND_IN:-}" ]; then bash -c "$PART_STAND_IN" stand-in "$1"; else "$2"; fi
}

# part NAME OWN_LIMIT_S FUNCTION: FUNCTION under its limit (limit_for), its output in $OUT/NAME.log (the tail
# shown here), how it ended appended to parts.jsonl, then the summary rewritten
part() {
    local name=$1 limit body=$3 started rc status
    started=$(date +%s)
    limit=$(limit_for "$2")
    if [ "$limit" -lt "$MIN_PART_S" ]; then
        echo "== $name skipped at $((started - T0)) s: ${limit} s left before the deadline (${DEADLINE_S} s)"
        printf '{"part": "%s", "status": "skipped", "rc": 0, "seconds": 0, "limit_s": %d}\n' \
            "$name" "$((limit > 0 ? limit : 0))" >> "$OUT/parts.jsonl"
        python3 "$SUMMARY" "$OUT" "$PLANNED" || echo "(the summary could not be written)"
        return 1
    fi
    echo "== $name (limit $limit s), at $((started - T0)) s"
    # SIGINT at the limit: pytest still writes its JUnit XML, the bench has written each run as it ended
    timeout --signal=INT --kill-after="$KILL_AFTER_S" "$limit" bash -c "body_of $name $body" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    status=ok
    if [ $rc = 124 ] || [ $rc = 137 ]; then status=cut; elif [ $rc != 0 ]; then status=failed; fi
    tail -n "${TAIL:-12}" "$OUT/$name.log"
    printf '{"part": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
        "$name" "$status" "$rc" "$(($(date +%s) - started))" "$limit" >> "$OUT/parts.jsonl"
    python3 "$SUMMARY" "$OUT" "$PLANNED" || echo "(the summary could not be written)"
    [ $status = ok ]
}

# pins.txt against what CI resolves today (.ci/run: a fresh environment, pip install -e '.[dev]', this
# machine's pip configuration); the rehearsal's, not the test suite's: a release changes the answer
ci_pins() {
    python3 -m pip install -q --dry-run --ignore-installed --report "$OUT/ci-resolution.json" -e '.[dev]' \
        || exit 1
    python3 benchmarks/gpu_carry/check_pins.py "$OUT/ci-resolution.json"
}

rehearsal_setup() {
    bash benchmarks/gpu_carry/make_carry.sh "$ROOT/.whl" || exit 1
    if ! cmp -s benchmarks/gpu_carry/image.txt "$IMAGE_VENV/image.txt"; then
        rm -rf "$IMAGE_VENV" && python3 -m venv "$IMAGE_VENV" || exit 1
        # --isolated: PyPI itself, past this machine's pip configuration (its local index and torch cap)
        "$IMAGE_VENV/bin/pip" install --isolated -q -r benchmarks/gpu_carry/image.txt || exit 1
        cp benchmarks/gpu_carry/image.txt "$IMAGE_VENV/image.txt"
    fi
    echo "the image's stand-in: $IMAGE_VENV, $("$PYTHON" -V), torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
}

carry() {
    ls .whl/*.whl > /dev/null || { echo "no .whl/: run benchmarks/gpu_carry/make_carry.sh, carry .whl"; exit 1; }
    local wheels tree
    wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
    if git rev-parse --git-dir > /dev/null 2>&1; then tree=$(git ls-files -z | xargs -0 cat | wc -c)
    else tree=$(du -sb --exclude=.whl --exclude="$(basename "$OUT")" . | cut -f1); fi
    echo "$(ls .whl/*.whl | wc -l) wheels, $((wheels / 1048576)) MiB; the tree $((tree / 1048576)) MiB"
    echo "carry: $(((wheels + tree) / 1048576)) MiB"
    # the wheels are for the image's CPython 3.12: a rehearsal on another Python installs them as for 3.12
    local as_312=()
    [ "$("$PYTHON" -c 'import sys; print(sys.version_info[:2] != (3, 12))')" = True ] \
        && as_312=(--python-version 3.12 --only-binary=:all:) \
        && echo "this Python is not 3.12: the cp312 wheels are installed as for 3.12 (av's compiled module, video only, does not load here)"
    rm -rf "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${as_312[@]}" \
        .whl/*.whl || exit 1
    echo "installed into $SITE, first on PYTHONPATH"
}

versions() {
    "$PYTHON" - <<'EOF' || exit 1
import importlib.metadata as m, json, os, platform, subprocess, torch
names = ["torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets", "pyarrow",
         "liger-kernel", "triton", "av", "qwen-vl-utils"]
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "MISSING"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
about = {
    "device": gpu or f"no GPU: CPU {platform.processor() or platform.machine()} (rehearsal)",
    "python": platform.python_version(),
    "libraries": {name: version(name) for name in names},
    "git_sha": sha or os.environ.get("GIT_SHA", "unknown"),
}
print(json.dumps(about, indent=2))
open(os.path.join(os.environ["OUT"], "versions.json"), "w").write(json.dumps(about, indent=2))
EOF
    "$PYTHON" -m pip check | tee "$OUT/pip-check.txt"
    true  # pip check's complaints are reported in the summary, not a failed part
}

gpu_tests() {
    "$PYTHON" -m pytest tests/test_on_a_gpu.py -n "${WORKERS:-8}" --dist load -q -rA -p no:cacheprovider \
        --junitxml="$OUT/gpu-tests.xml"
}

bench() {
    while [ -f "$OUT/.building-2b" ]; do sleep 2; done  # the 2B-shaped model, built during the tests
    "$PYTHON" -m vlm_recipes bench --model demo:qwen2-vl-2b-shaped --precision bf16 --scenarios first-epoch \
        --stages "${STAGES:-llm-lora,vision-full}" --without-overhead-check --repeats 1 --rows "${ROWS:-32}" \
        --threads 8 --out "$OUT/bench.json"
}

rehearsal_r1() {
    rm -rf "$OUT/r1"
    # the demo model's random weights, as the tests take them: its pretraining is no part of the rehearsal
    VLM_RECIPES_DEMO_WEIGHTS=untrained "$PYTHON" scripts/train_recipe.py --recipe r1-llm-only --output-dir "$OUT/r1" --run-name rehearsal \
        --max-steps 2 training.per_device_batch_size=4 data.max_train_samples=8 data.max_eval_samples=4 \
        evaluation.max_new_tokens=4
}

# Qwen2-VL-2B's shape with random weights (4.4 GB), built on the CPU while the GPU tests run
build_2b() {
    "$PYTHON" -c "from vlm_recipes.demo.models import ensure_demo_model as e; print(e('demo:qwen2-vl-2b-shaped'))"
}

export -f body_of ci_pins rehearsal_setup carry versions gpu_tests bench rehearsal_r1 build_2b
export REHEARSE IMAGE_VENV PART_STAND_IN
if [ $REHEARSE = 1 ]; then
    part pins "${PINS_S:-300}" ci_pins
    part rehearsal-setup "${SETUP_S:-900}" rehearsal_setup || exit 1
fi
part carry "${CARRY_S:-45}" carry || { cat "$OUT/summary.md"; exit 1; }
part versions "${VERSIONS_S:-45}" versions
if [ $REHEARSE = 1 ]; then
    WORKERS=2 part gpu-tests "${TESTS_S:-300}" gpu_tests
    part rehearsal-r1 "${R1_S:-600}" rehearsal_r1
else
    touch "$OUT/.building-2b"
    # its own process group, so that what is still building when the visit ends is stopped with it
    setsid bash -c 'body_of build-2b build_2b; rm -f "$OUT/.building-2b"' > "$OUT/build-2b.log" 2>&1 &
    BUILDING=$!
    part gpu-tests "${TESTS_S:-290}" gpu_tests
    part bench "${BENCH_S:-200}" bench
    kill -- -"$BUILDING" 2> /dev/null && echo "(the 2B-shaped model's build stopped: the visit ends)"
fi
echo "== done at $(($(date +%s) - T0)) s: $OUT/summary.md"
cat "$OUT/summary.md"
python3 -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['all_ok'] else 1)" "$OUT/gpu-check.json"

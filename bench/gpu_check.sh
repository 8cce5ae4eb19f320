#!/usr/bin/env bash
# The whole GPU verification of gds_persist in one go, for a fresh GPU machine with no network.
# Fits in about 9 minutes by default (--budget-s: each step's time limit is what is left, and the
# later drive and tmpfs sizes shrink to what the first size's speed says will fit).
#
#   bash bench/gpu_check.sh [--out DIR] [--wheels DIR] [--sizes "1GiB 8GiB"] [--runs "2 1"]
#                           [--dir DIR] [--python PY] [--budget-s 540] [--device cuda|cpu]
#                           [--tmpfs-dir DIR] [--tmpfs-size 8GiB] [--warmup-size 1GiB]
#                           [--train-args "..."] [--tests "PATHS"] [--no-tests] [--no-bench]
#                           [--no-warmup] [--no-train] [--no-tmpfs] [--no-pack]
#
#   --out DIR      where everything goes (default: $OUT if set, else bench/results/gpu-<UTC time>):
#                  summary.md and gpu_check.tar.gz (every other file, summary.md included), so
#                  at most 8 files come back from a device machine; --no-pack leaves them loose
#                  in DIR/gpu_check/
#   --wheels DIR   wheels to install from when kvikio (or awscrt, crc32c, blake3, blosc2,
#                  hypothesis) is missing: kvikio-cu13, libkvikio-cu13, rapids-logger,
#                  cuda-pathfinder, nvidia-cufile, awscrt, crc32c, blake3, blosc2, ndindex,
#                  hypothesis, sortedcontainers
#                  (bench/fetch_gpu_wheels.sh downloads them on a machine with network).
#                  Installed with --no-index: nothing is fetched.
#   --sizes/--runs state dict sizes for the drive comparison and runs per size (pairwise)
#   --dir DIR      directory on the drive under test (default: bench/out under the repository)
#   --tmpfs-dir    RAM as the drive, the data path's own ceiling (default /dev/shm/gds_persist-gpu_check)
#   --tmpfs-size   state size there (default 8GiB; shrunk to the time left and the tmpfs's room)
#   --warmup-size  state size of the first-save-vs-next benchmark (default 1GiB)
#   --train-args   bench/bench_train.py's model and timing (default: the 85 M-parameter GPT of the
#                  first H200 run, 1.02 GB checkpoint, 5 iterations x 2 rounds; --tiny with cpu)
#   --tests PATHS  what `pytest -m gpu` collects (default tests; the CPU dry run of CI narrows it,
#                  since collecting the whole suite takes most of that run)
#   --budget-s N   stop starting new work after N seconds (default 540)
#   --device cpu   a dry run of this script itself on a machine without a GPU (tests it on CI):
#                  nothing GPU-related is verified then, and the summary says so
#
# Steps: 1. facts (GPU, driver, PCIe, NUMA, kvikio/GDS mode and why) -> facts.{txt,json}
#        2. kvikio (and awscrt, crc32c, blake3, blosc2) from --wheels if not importable
#        3. pytest -m gpu --strict-gpu=on tests/: a skipped GPU test counts as a failure
#           (this includes tests/test_docs_examples.py: the README and docs blocks marked
#           <!-- doc-test: gpu -->, run as written) -> pytest-gpu.{txt,xml}
#        4. bench/bench_io.py --device cuda at the first size: kvikio (GDS, cuFile or KvikIO compat),
#           kvikio with KvikIO compat forced, direct (pinned D2H pipeline), torch.save, DCP,
#           save and load, against the drive limit of the same run -> bench-SIZE.{txt,json}
#        5. bench/bench_warmup.py: the first save of a process vs the next, with and without
#           gds_persist.warmup() (auto and kvikio) -> warmup.{txt,json}
#        6. bench/bench_train.py --device cuda: iteration time with a checkpoint every step, per
#           Checkpointer mode (auto included) -> train.{txt,json}
#        7. bench/bench_io.py on tmpfs (RAM as the drive) -> tmpfs-SIZE.{txt,json}
#        8. the drive comparison at the other sizes -> bench-SIZE.{txt,json}
#        9. summary.md: date, GPU, driver, GDS status, test outcome, the tables; then the tarball
# Exit status: 0 all passed; 1 a test or benchmark failed (or a GPU test skipped); 3 no CUDA
# device (nothing verified, the reason is in summary.md); 2 bad arguments.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-}"
WHEELS=""
SIZES="1GiB 8GiB"
RUNS="2 1"
BENCH_DIR=""
PY="${PYTHON:-python3}"
BUDGET=540
DO_TESTS=1
DO_BENCH=1
DO_WARMUP=1
DO_TRAIN=1
DO_TMPFS=1
PACK=1
DEVICE=cuda
TMPFS_DIR=/dev/shm/gds_persist-gpu_check
TMPFS_SIZE=8GiB
WARMUP_SIZE=1GiB
TRAIN_ARGS=""
TEST_PATHS="tests"
H200_TRAIN="--d-model 1024 --layers 6 --heads 16 --vocab 8192 --seq 1024 --batch 48 --iters 5 --warmup 2 --rounds 2"

usage() { sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; }  # the header comment, whatever its length
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --sizes) SIZES="$2"; shift 2 ;;
        --runs) RUNS="$2"; shift 2 ;;
        --dir) BENCH_DIR="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --budget-s) BUDGET="$2"; shift 2 ;;
        --tmpfs-dir) TMPFS_DIR="$2"; shift 2 ;;
        --tmpfs-size) TMPFS_SIZE="$2"; shift 2 ;;
        --warmup-size) WARMUP_SIZE="$2"; shift 2 ;;
        --train-args) TRAIN_ARGS="$2"; shift 2 ;;
        --tests) TEST_PATHS="$2"; shift 2 ;;
        --no-tests) DO_TESTS=0; shift ;;
        --no-bench) DO_BENCH=0; shift ;;
        --no-warmup) DO_WARMUP=0; shift ;;
        --no-train) DO_TRAIN=0; shift ;;
        --no-tmpfs) DO_TMPFS=0; shift ;;
        --no-pack) PACK=0; shift ;;
        --device) DEVICE="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in
    cuda) STRICT=on; [ -n "$TRAIN_ARGS" ] || TRAIN_ARGS="$H200_TRAIN" ;;
    cpu) STRICT=off; [ -n "$TRAIN_ARGS" ] || TRAIN_ARGS="--tiny" ;;
    *) echo "gpu_check.sh: --device must be cuda or cpu" >&2; exit 2 ;;
esac
# Arguments are checked before anything is created.
read -r -a SIZE_LIST <<< "$SIZES"
read -r -a RUN_LIST <<< "$RUNS"
if [ "${#SIZE_LIST[@]}" -ne "${#RUN_LIST[@]}" ]; then
    echo "gpu_check.sh: --sizes and --runs need the same number of entries" >&2; exit 2
fi
[ -n "$OUT_DIR" ] || OUT_DIR="$REPO/bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)"
[ -n "$BENCH_DIR" ] || BENCH_DIR="$REPO/bench/out"
mkdir -p "$OUT_DIR" "$BENCH_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

RUN_DIR="$OUT_DIR/gpu_check"  # every file of the run; packed into one tarball at the end
rm -rf "$RUN_DIR" "$OUT_DIR/gpu_check.tar.gz"
mkdir -p "$RUN_DIR" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUFILE_LOGFILE_PATH="$RUN_DIR/cufile.log"  # libcufile's log: with the results
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$REPO" || exit 2
SUMMARY="$OUT_DIR/summary.md"
LOG="$RUN_DIR/gpu_check.log"
STATUS=0
START=$SECONDS
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET - (SECONDS - START))); }
importable() { "$PY" -c "import $1" >/dev/null 2>&1; }
section() {  # $1: title, $2: exit status, $3: file shown as a code block
    { echo; echo "## $1 (exit $2)"; echo; echo '```'; cat "$3" 2>/dev/null; echo '```'; } >> "$SUMMARY"
}
pack() {  # summary.md stays beside one tarball of everything: at most 8 files come back
    cp "$SUMMARY" "$RUN_DIR/summary.md" 2>/dev/null
    if [ "$PACK" = 1 ]; then
        tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$OUT_DIR" gpu_check && rm -rf "$RUN_DIR"
    fi
}
trap 'rc=$?; pack; exit $rc' EXIT

{
    echo "# gds_persist GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- host: $(hostname)"
    echo "- commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "- files: this summary, and gpu_check.tar.gz with every output (summary included)"
} > "$SUMMARY"

# -- 2. wheels first, so that the facts below see what the run will use ----------------------------
install_from_wheels() {  # $@: distribution names
    if [ -z "$WHEELS" ]; then
        log "not installing $*: no --wheels DIR given"
        return 1
    fi
    log "installing $* from $WHEELS (no network)"
    if ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@" >> "$LOG" 2>&1; then
        log "  with dependencies failed (see $LOG); retrying without them (--no-deps)"
        "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$@" >> "$LOG" 2>&1 || true
    fi
}
# gds_persist's own dependencies (pyproject.toml) that a CUDA torch image lacks: module wheel...
# (blosc2 also needs ndindex; its other needs come with the image; tests/test_gpu_check.py keeps
# this list and bench/fetch_gpu_wheels.sh in step with pyproject.toml)
CORE_DEPS=("awscrt awscrt" "crc32c crc32c" "blake3 blake3" "blosc2 blosc2 ndindex")
MISSING_CORE=""
for dep in "${CORE_DEPS[@]}"; do
    read -r module wheels <<< "$dep"
    importable "$module" || install_from_wheels $wheels
    importable "$module" || MISSING_CORE="$MISSING_CORE $module"
done
if [ -n "$MISSING_CORE" ]; then  # the tests and steps that need them fail: say why up front
    log "gds_persist dependencies not importable:$MISSING_CORE (put their wheels in --wheels)"
    echo "- **missing dependencies**:$MISSING_CORE (not importable, no wheel in --wheels): the tests and steps that use them fail" >> "$SUMMARY"
fi
if ! importable gds_persist; then
    log "gds_persist is not importable with $PY (PYTHONPATH=$REPO): $("$PY" -c 'import gds_persist' 2>&1 | tail -1)"
    echo "- **NOT RUN**: gds_persist not importable (missing dependency? pass --wheels)" >> "$SUMMARY"
    exit 1
fi
if ! importable kvikio; then
    install_from_wheels kvikio-cu13 libkvikio-cu13 rapids-logger cuda-pathfinder nvidia-cufile
fi
if [ "$DO_TESTS" = 1 ] && ! importable hypothesis; then  # the conformance suite uses it
    install_from_wheels hypothesis sortedcontainers
fi
importable kvikio || log "kvikio still not importable: the kvikio rows and tests will say why"

# -- 1. facts -------------------------------------------------------------------------------------
log "facts"
"$PY" bench/gpu_facts.py --json "$RUN_DIR/facts.json" > "$RUN_DIR/facts.txt" 2>> "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi > "$RUN_DIR/nvidia-smi.txt" 2>&1
{
    echo
    echo "## Machine"
    echo
    echo '```'
    cat "$RUN_DIR/facts.txt"
    echo '```'
} >> "$SUMMARY"
CUDA="$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['cuda'])" "$RUN_DIR/facts.json" 2>/dev/null)"
if [ "$DEVICE" = cpu ]; then
    log "--device cpu: a dry run of the script; nothing GPU-related is verified"
    echo -e "\n**DRY RUN on the CPU (--device cpu): nothing GPU-related was verified.**" >> "$SUMMARY"
elif [ "$CUDA" != "True" ]; then
    log "no CUDA device: nothing to verify here (see facts.txt)"
    printf '\n**NOT RUN: no CUDA device** (%s). The GPU verification needs a machine with a GPU.\n' \
        "$(grep why_no_cuda "$RUN_DIR/facts.txt" | sed 's/^why_no_cuda *//')" >> "$SUMMARY"
    exit 3
fi

# -- 3. tests -------------------------------------------------------------------------------------
if [ "$DO_TESTS" = 1 ]; then
    # every test marked gpu: the kernel and kvikio/pinned-path tests, and the kvikio case of the
    # conformance suite (tests/conftest.py's backend fixture: CUDA tensors through kvikio).
    # --strict-gpu=on (tests/strict_gpu.py): on the GPU machine a skip is a failure.
    read -r -a TEST_LIST <<< "$TEST_PATHS"
    log "pytest -m gpu --strict-gpu=$STRICT ${TEST_LIST[*]}"
    timeout $(( $(left) > 300 ? 240 : $(left) / 2 )) "$PY" -m pytest -m gpu -p no:cacheprovider \
        --strict-gpu="$STRICT" --continue-on-collection-errors -q -rA \
        --junitxml="$RUN_DIR/pytest-gpu.xml" "${TEST_LIST[@]}" > "$RUN_DIR/pytest-gpu.txt" 2>&1
    rc=$?
    tail -n 40 "$RUN_DIR/pytest-gpu.txt" | grep -E "passed|failed|error|skipped" | tail -n 1 | tee -a "$LOG"
    skipped="$("$PY" -c "
import sys, xml.etree.ElementTree as ET
print(sum(int(s.get('skipped', 0)) for s in ET.parse(sys.argv[1]).getroot().iter('testsuite')))" \
        "$RUN_DIR/pytest-gpu.xml" 2>/dev/null || echo unknown)"
    {
        echo
        echo "## pytest -m gpu --strict-gpu=$STRICT (exit $rc)"
        echo
        if [ "$DEVICE" = cuda ] && [ "$skipped" != 0 ]; then
            echo "**FAILED: $skipped GPU test(s) skipped on a GPU machine** (a skipped GPU test hides a broken GPU path)"
            echo
        elif [ "$DEVICE" = cpu ]; then
            echo "$skipped GPU test(s) skipped: expected in a dry run without a GPU"
            echo
        fi
        echo '```'
        grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$RUN_DIR/pytest-gpu.txt" | tail -n 80
        echo '```'
    } >> "$SUMMARY"
    [ "$rc" = 0 ] || STATUS=1
    if [ "$DEVICE" = cuda ] && [ "$skipped" != 0 ]; then
        log "FAILED: $skipped GPU test(s) skipped on a GPU machine"
        STATUS=1
    fi
fi

# -- 4-8. benchmarks ------------------------------------------------------------------------------
gib() { "$PY" -c "import sys; from bench.bench_io import parse_size; print(parse_size(sys.argv[1]) / 2**30)" "$1"; }
first_rate=""  # seconds per (GiB x run) of the drive comparison at the first size
fit() {  # $1: GiB wanted, $2: runs, $3: directory -> GiB that fits the time left and the room there
    local free_gib
    free_gib="$("$PY" -c "import shutil,sys; print(shutil.disk_usage(sys.argv[1]).free / 2**30)" "$3")"
    "$PY" -c "
import sys
g, runs, rate, left, free = (float(a) for a in sys.argv[1:])
def fits(g):
    return g * runs * rate * 1.25 <= left - 20 and g * 1.2 <= free
while not fits(g) and g >= 2:
    g /= 2
print(g if fits(g) else 0)" "$1" "$2" "${first_rate:-0}" "$(left)" "$free_gib"
}
compare() {  # $1: size, $2: runs, $3: directory, $4: file stem, $5: methods, $6: DCP threads
    local size="$1" runs="$2" dir="$3" stem="$4" rc t0 g
    g="$(gib "$size")" || { log "bad size $size"; STATUS=1; return 1; }
    if [ -n "$first_rate" ]; then  # shrink to what the time left and the free room allow
        g="$(fit "$g" "$runs" "$dir")"
        if [ "$g" = 0 ]; then
            log "skipping $stem-$size: not enough time budget or room left"
            echo -e "\n- $stem-$size: skipped (time budget $(left) s left, or no room in $dir)" >> "$SUMMARY"
            return 0
        fi
        if [ "$(gib "$size")" != "$g" ]; then
            log "$stem-$size shrunk to ${g}GiB to fit the time budget / free room"
            size="${g}GiB"
        fi
    fi
    log "bench $stem-$size x $runs runs in $dir ($5)"
    t0=$SECONDS
    timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PY" bench/bench_io.py --device "$DEVICE" \
        --size "$size" --runs "$runs" --methods "$5" --dir "$dir" --dcp-threads "$6" \
        --json "$RUN_DIR/$stem-$size.json" > "$RUN_DIR/$stem-$size.txt" 2> "$RUN_DIR/$stem-$size.err"
    rc=$?
    section "$stem-$size: $runs run(s) in $dir" "$rc" "$RUN_DIR/$stem-$size.txt"
    if [ "$rc" != 0 ]; then
        log "bench $stem-$size failed (exit $rc): $(tail -n 3 "$RUN_DIR/$stem-$size.err")"
        STATUS=1
        return 1
    fi
    if grep -q "FAILED" "$RUN_DIR/$stem-$size.txt" "$RUN_DIR/$stem-$size.err"; then
        log "bench $stem-$size: a method FAILED (see $stem-$size.txt)"
        STATUS=1
    fi
    if [ -z "$first_rate" ]; then
        first_rate="$("$PY" -c "import sys; print(max(1, int(sys.argv[1])) / (float(sys.argv[2]) * int(sys.argv[3])))" "$((SECONDS - t0))" "$g" "$runs")"
        DCP_BEST="$("$PY" -c "
import json, sys
m = [x for x in json.load(open(sys.argv[1]))['methods'] if x['key'] == 'dcp']
print((m[0].get('info') or {}).get('thread_count', 4) if m else 4)" "$RUN_DIR/$stem-$size.json" 2>/dev/null || echo 4)"
    fi
}
run_step() {  # $1: name (files NAME.txt/.json), $2: seconds at most, then the command
    local name="$1" limit="$2" rc
    shift 2
    if [ "$(left)" -lt 20 ]; then
        log "skipping $name: time budget spent"
        echo -e "\n- $name: skipped (time budget spent)" >> "$SUMMARY"
        return 0
    fi
    [ "$limit" -le "$(left)" ] || limit="$(left)"
    log "$name: $* (at most $limit s)"
    timeout "$limit" "$@" > "$RUN_DIR/$name.txt" 2> "$RUN_DIR/$name.err"
    rc=$?
    section "$name" "$rc" "$RUN_DIR/$name.txt"
    if [ "$rc" != 0 ]; then
        log "$name failed (exit $rc): $(tail -n 3 "$RUN_DIR/$name.err")"
        STATUS=1
    fi
}

if [ "$DO_BENCH" = 1 ]; then
    METHODS="gds-kvikio,gds-kvikio-compat,gds-direct,torch,dcp"
    echo -e "\n## Benchmarks (--device $DEVICE; GB/s of payload, save durable, load cold)" >> "$SUMMARY"
    compare "${SIZE_LIST[0]}" "${RUN_LIST[0]}" "$BENCH_DIR" bench "$METHODS" "1,4,8"
    if [ "$DO_WARMUP" = 1 ]; then
        backends=auto
        [ "$DEVICE" = cuda ] && importable kvikio && backends=auto,kvikio
        run_step warmup 150 "$PY" bench/bench_warmup.py --device "$DEVICE" --size "$WARMUP_SIZE" \
            --saves 3 --rounds 1 --backends "$backends" --dir "$BENCH_DIR" --json "$RUN_DIR/warmup.json"
    fi
    if [ "$DO_TRAIN" = 1 ]; then
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list of arguments
        run_step train 240 "$PY" bench/bench_train.py --device "$DEVICE" $TRAIN_ARGS \
            --dir "$BENCH_DIR" --json "$RUN_DIR/train.json"
    fi
    if [ "$DO_TMPFS" = 1 ]; then
        if mkdir -p "$TMPFS_DIR" 2>/dev/null && [ -w "$TMPFS_DIR" ]; then
            compare "$TMPFS_SIZE" 1 "$TMPFS_DIR" tmpfs "gds-direct,gds-kvikio,gds-buffered,torch" 1
            rmdir "$TMPFS_DIR" 2>/dev/null
        else
            log "no tmpfs run: cannot write to $TMPFS_DIR"
            echo -e "\n- tmpfs: skipped (cannot write to $TMPFS_DIR)" >> "$SUMMARY"
        fi
    fi
    for i in "${!SIZE_LIST[@]}"; do
        [ "$i" = 0 ] || compare "${SIZE_LIST[$i]}" "${RUN_LIST[$i]}" "$BENCH_DIR" bench "$METHODS" "${DCP_BEST:-4}"
    done
fi

log "done in $((SECONDS - START)) s; status $STATUS; results in $OUT_DIR"
echo -e "\n- elapsed: $((SECONDS - START)) s; exit status $STATUS" >> "$SUMMARY"
exit "$STATUS"

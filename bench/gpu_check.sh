#!/usr/bin/env bash
# The whole GPU verification of gds_persist in one go, for a fresh GPU machine with no network.
# Finishes in under 10 minutes by default (a time budget shrinks or skips the large size).
#
#   bash bench/gpu_check.sh [--out DIR] [--wheels DIR] [--sizes "1GiB 16GiB"] [--runs "3 1"]
#                           [--dir DIR] [--python PY] [--budget-s 540] [--no-tests] [--no-bench]
#
#   --out DIR      where everything goes (default: $OUT if set, else bench/results/gpu-<UTC time>)
#   --wheels DIR   wheels to install from when kvikio (or crc32c, hypothesis) is missing:
#                  kvikio-cu13, libkvikio-cu13, rapids-logger, cuda-pathfinder, nvidia-cufile,
#                  crc32c, hypothesis, sortedcontainers
#                  (bench/fetch_gpu_wheels.sh downloads them on a machine with network).
#                  Installed with --no-index: nothing is fetched.
#   --sizes/--runs state dict sizes for the comparison and runs per size (pairwise)
#   --dir DIR      directory on the drive under test (default: bench/out under the repository)
#   --budget-s N   stop starting new work after N seconds (default 540)
#   --device cpu   a dry run of this script itself on a machine without a GPU (tests it on CI):
#                  nothing GPU-related is verified then, and the summary says so
#
# Steps: 1. facts (GPU, driver, PCIe, NUMA, kvikio/GDS mode and why) -> facts.{txt,json}
#        2. kvikio (and crc32c) from --wheels if not importable
#        3. pytest -m gpu tests/ (hypothesis from --wheels if missing) -> pytest-gpu.{txt,xml}
#        4. bench/bench_io.py --device cuda per size: kvikio (GDS or cuFile compat), kvikio with
#           KvikIO compat forced, direct (pinned D2H pipeline), torch.save, DCP, save and load,
#           against the drive limit of the same run -> bench-SIZE.{txt,json}
#        5. summary.md: date, GPU, driver, GDS status, test outcome, the tables
# Exit status: 0 all passed; 1 a test or benchmark failed; 3 no CUDA device (nothing verified,
# the reason is in summary.md); 2 bad arguments.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-}"
WHEELS=""
SIZES="1GiB 16GiB"
RUNS="3 1"
BENCH_DIR=""
PY="${PYTHON:-python3}"
BUDGET=540
DO_TESTS=1
DO_BENCH=1
DEVICE=cuda

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --sizes) SIZES="$2"; shift 2 ;;
        --runs) RUNS="$2"; shift 2 ;;
        --dir) BENCH_DIR="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --budget-s) BUDGET="$2"; shift 2 ;;
        --no-tests) DO_TESTS=0; shift ;;
        --no-bench) DO_BENCH=0; shift ;;
        --device) DEVICE="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -n "$OUT_DIR" ] || OUT_DIR="$REPO/bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)"
[ -n "$BENCH_DIR" ] || BENCH_DIR="$REPO/bench/out"
mkdir -p "$OUT_DIR" "$BENCH_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
read -r -a SIZE_LIST <<< "$SIZES"
read -r -a RUN_LIST <<< "$RUNS"
if [ "${#SIZE_LIST[@]}" -ne "${#RUN_LIST[@]}" ]; then
    echo "gpu_check.sh: --sizes and --runs need the same number of entries" >&2; exit 2
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUFILE_LOGFILE_PATH="$OUT_DIR/cufile.log"  # libcufile's log: with the results
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$REPO" || exit 2
SUMMARY="$OUT_DIR/summary.md"
LOG="$OUT_DIR/gpu_check.log"
STATUS=0
START=$SECONDS
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET - (SECONDS - START))); }
importable() { "$PY" -c "import $1" >/dev/null 2>&1; }

{
    echo "# gds_persist GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- host: $(hostname)"
    echo "- commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
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
if ! importable crc32c; then install_from_wheels crc32c; fi
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
"$PY" bench/gpu_facts.py --json "$OUT_DIR/facts.json" > "$OUT_DIR/facts.txt" 2>> "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
{
    echo
    echo "## Machine"
    echo
    echo '```'
    cat "$OUT_DIR/facts.txt"
    echo '```'
} >> "$SUMMARY"
CUDA="$("$PY" -c "import json; print(json.load(open('$OUT_DIR/facts.json'))['cuda'])" 2>/dev/null)"
if [ "$DEVICE" = cpu ]; then
    log "--device cpu: a dry run of the script; nothing GPU-related is verified"
    echo -e "\n**DRY RUN on the CPU (--device cpu): nothing GPU-related was verified.**" >> "$SUMMARY"
elif [ "$DEVICE" != cuda ]; then
    echo "gpu_check.sh: --device must be cuda or cpu" >&2; exit 2
elif [ "$CUDA" != "True" ]; then
    log "no CUDA device: nothing to verify here (see $OUT_DIR/facts.txt)"
    printf '\n**NOT RUN: no CUDA device** (%s). The GPU verification needs a machine with a GPU.\n' \
        "$(grep why_no_cuda "$OUT_DIR/facts.txt" | sed 's/^why_no_cuda *//')" >> "$SUMMARY"
    exit 3
fi

# -- 3. tests -------------------------------------------------------------------------------------
if [ "$DO_TESTS" = 1 ]; then
    # every test marked gpu: the kernel and kvikio/pinned-path tests, and the kvikio case of the
    # conformance suite (tests/conftest.py's backend fixture: CUDA tensors through kvikio)
    log "pytest -m gpu tests/"
    timeout $(( $(left) > 300 ? 240 : $(left) / 2 )) "$PY" -m pytest -m gpu -p no:cacheprovider \
        --continue-on-collection-errors -q -rA --junitxml="$OUT_DIR/pytest-gpu.xml" \
        tests > "$OUT_DIR/pytest-gpu.txt" 2>&1
    rc=$?
    tail -n 40 "$OUT_DIR/pytest-gpu.txt" | grep -E "passed|failed|error|skipped" | tail -n 1 | tee -a "$LOG"
    {
        echo
        echo "## pytest -m gpu (exit $rc)"
        echo
        echo '```'
        grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT_DIR/pytest-gpu.txt" | tail -n 80
        echo '```'
    } >> "$SUMMARY"
    [ "$rc" = 0 ] || STATUS=1
fi

# -- 4. comparison --------------------------------------------------------------------------------
gib() { "$PY" -c "import sys; from bench.bench_io import parse_size; print(parse_size(sys.argv[1]) / 2**30)" "$1"; }
if [ "$DO_BENCH" = 1 ]; then
    METHODS="gds-kvikio,gds-kvikio-compat,gds-direct,torch,dcp"
    first_rate=""  # seconds per (GiB x run), from the first size
    echo -e "\n## Comparison (--device $DEVICE; GB/s of payload, save durable, load cold)\n" >> "$SUMMARY"
    for i in "${!SIZE_LIST[@]}"; do
        size="${SIZE_LIST[$i]}"; runs="${RUN_LIST[$i]}"
        g="$(gib "$size")" || { log "bad size $size"; STATUS=1; continue; }
        free_gib="$("$PY" -c "import shutil,sys; print(shutil.disk_usage(sys.argv[1]).free / 2**30)" "$BENCH_DIR")"
        if [ -n "$first_rate" ]; then  # shrink the size to what the remaining budget allows
            g="$("$PY" -c "
import sys
g, runs, rate, left, free = (float(a) for a in sys.argv[1:])
def fits(g):
    return g * runs * rate * 1.25 <= left - 20 and g * 1.2 <= free
while not fits(g) and g >= 2:
    g /= 2
print(g if fits(g) else 0)" "$g" "$runs" "$first_rate" "$(left)" "$free_gib")"
            if [ "$g" = 0 ]; then
                log "skipping $size: not enough time budget or disk left"
                echo "- $size: skipped (time budget $(left) s left or disk $free_gib GiB free)" >> "$SUMMARY"
                continue
            fi
            if [ "$(gib "$size")" != "$g" ]; then
                log "$size shrunk to ${g}GiB to fit the time budget / free disk"
                size="${g}GiB"
            fi
        fi
        dcp="1,4,8"
        [ -z "$first_rate" ] || dcp="$DCP_BEST"
        log "bench $size x $runs runs ($METHODS)"
        t0=$SECONDS
        timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PY" bench/bench_io.py --device "$DEVICE" \
            --size "$size" --runs "$runs" --methods "$METHODS" --dir "$BENCH_DIR" \
            --dcp-threads "$dcp" --json "$OUT_DIR/bench-$size.json" \
            > "$OUT_DIR/bench-$size.txt" 2> "$OUT_DIR/bench-$size.err"
        rc=$?
        {
            echo "### $size, $runs run(s) (exit $rc)"
            echo
            echo '```'
            cat "$OUT_DIR/bench-$size.txt"
            echo '```'
            echo
        } >> "$SUMMARY"
        if [ "$rc" != 0 ]; then
            log "bench $size failed (exit $rc): $(tail -n 3 "$OUT_DIR/bench-$size.err")"
            STATUS=1
            continue
        fi
        if grep -q "FAILED" "$OUT_DIR/bench-$size.txt" "$OUT_DIR/bench-$size.err"; then
            log "bench $size: a method FAILED (see bench-$size.txt)"
            STATUS=1
        fi
        if [ -z "$first_rate" ]; then
            first_rate="$("$PY" -c "import sys; print(max(1, int(sys.argv[1])) / (float(sys.argv[2]) * int(sys.argv[3])))" "$((SECONDS - t0))" "$g" "$runs")"
            DCP_BEST="$("$PY" -c "
import json, sys
m = [x for x in json.load(open(sys.argv[1]))['methods'] if x['key'] == 'dcp']
print((m[0].get('info') or {}).get('thread_count', 4) if m else 4)" "$OUT_DIR/bench-$size.json" 2>/dev/null || echo 4)"
        fi
    done
fi

log "done in $((SECONDS - START)) s; status $STATUS; results in $OUT_DIR"
echo -e "\n- elapsed: $((SECONDS - START)) s; exit status $STATUS" >> "$SUMMARY"
exit "$STATUS"

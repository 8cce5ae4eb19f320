#!/bin/sh
# bench_io.py's table (1 GiB, gds-auto, its torch file and torch) N times a tree, alternating the
# tree FIRST (default a worktree at 33e81e3, staged fresh destinations) with SECOND (default
# this tree); run once as at 1fecf0d (aligned), then with FIRST a worktree at 1fecf0d and SECOND
# the tree after its revert.
#   sh bench/results/2026-12-05-cpu-issue44-h/bench_io_ab.sh DIR N [FIRST [SECOND]]
first="${3:-/tmp/before}"
second="${4:-.}"
for i in $(seq 1 "$2"); do
  for tree in "$first" "$second"; do
    echo "== run $i, tree $tree"
    .venv/bin/python "$tree/bench/bench_io.py" --size 1GiB --runs 3 \
      --methods gds-auto,gds-torch,torch --dir "$1" | grep -E "^(save|load) |load, run"
  done
done

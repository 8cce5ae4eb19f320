#!/bin/sh
# bench_limit.py in 2N fresh processes, alternating the tree before the awscrt CRC32C (BEFORE, a
# worktree at a3aefc2) with this one, so each process draws its own memory and neither side
# always runs first.
#   git worktree add /tmp/before a3aefc2
#   sh bench/results/2026-12-05-cpu-issue44-f/crc_ab.sh DIR N RUNS [BEFORE]
before="${4:-/tmp/before}"
for i in $(seq 1 "$2"); do
  for tree in "$before" .; do
    echo "== process $i, tree $tree"
    PYTHONPATH="$tree" .venv/bin/python "$tree/bench/bench_limit.py" --size 1GiB --runs "$3" \
      --dir "$1" | tail -3
  done
done

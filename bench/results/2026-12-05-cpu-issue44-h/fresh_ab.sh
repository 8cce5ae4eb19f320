#!/bin/sh
# fresh_ab.py in 2N fresh processes, alternating the tree before aligned fresh destinations
# (BEFORE, a worktree at 33e81e3) with this one; the read-mode history is removed first.
#   git worktree add /tmp/before 33e81e3
#   sh bench/results/2026-12-05-cpu-issue44-h/fresh_ab.sh WORKDIR N ROUNDS [BEFORE]
before="${4:-/tmp/before}"
rm -f ~/.cache/gds_persist/read-modes.json
for i in $(seq 1 "$2"); do
  for tree in "$before" .; do
    echo "== process $i, tree $tree"
    PYTHONPATH="$tree" .venv/bin/python bench/results/2026-12-05-cpu-issue44-h/fresh_ab.py \
      "$1" "$3"
  done
done

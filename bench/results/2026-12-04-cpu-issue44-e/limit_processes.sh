#!/bin/sh
# bench_limit.py in N fresh processes (each draws its own memory for the limit and the ring).
#   sh bench/results/2026-12-04-cpu-issue44-e/limit_processes.sh DIR N RUNS
for i in $(seq 1 "$2"); do
  echo "== process $i"
  PYTHONPATH=. .venv/bin/python bench/bench_limit.py --size 1GiB --runs "$3" --dir "$1" | tail -3
done

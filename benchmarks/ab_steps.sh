#!/usr/bin/env bash
# Phase-by-phase A/B of the end-to-end batch (benchmarks/step_breakdown.py) between this
# checkout and $OLD, alternated: bash benchmarks/ab_steps.sh [batch] [rounds]
set -u
B=${1:-64}; R=${2:-2}; NEW=$PWD
for r in $(seq "$R"); do
  for c in "$OLD" "$NEW"; do
    echo "# round $r $( [ "$c" = "$NEW" ] && echo new || echo old)"
    (cd "$c" && PYTHONPATH=$c:${PYTHONPATH:-} timeout 240 python3 benchmarks/step_breakdown.py --device cuda --batch "$B" 2>&1 | grep -E "^step_breakdown|Error|error" | tail -5)
  done
done

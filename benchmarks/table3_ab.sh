#!/bin/bash
# A reduced uniform MimiC Table 3 (15 runs: 5 methods x 3 tau_max, 1 trial, 20 rounds, the default lockstep
# executor) with two code trees one after the other on a quiet machine: wall and CPU time of the whole command, and
# whether every run's model.pt is byte-identical between the two (issue 16, item 3: whole experiments).
#
#   git worktree add /tmp/before <rev>; git worktree add /tmp/after HEAD
#   benchmarks/table3_ab.sh /tmp/before /tmp/after [rounds]
set -euo pipefail
BEFORE=$1 AFTER=$2 ROUNDS=${3:-20}
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
OUT=$(mktemp -d)
run() {  # $1 tree, $2 tag
  echo "== $2: $1, start $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd "$1" && /usr/bin/time -f "$2: wall %e s, user %U s, sys %S s, max RSS %M KB" "$PY" -c \
    "import sys; sys.argv[0] = 'dropfl'; from coordinator.cli import main; sys.exit(main())" \
    reproduce mimic-table3 --trials 1 --rounds "$ROUNDS" --out "$OUT/$2" --results "$OUT/res-$2" --no-progress \
    > "$OUT/$2.log" 2>&1)
  tail -1 "$OUT/$2.log"
}
run "$BEFORE" before
run "$AFTER" after
same=0 n=0
for f in "$OUT"/before/*/model.pt; do
  n=$((n + 1)); cmp -s "$f" "$OUT/after/$(basename "$(dirname "$f")")/model.pt" && same=$((same + 1))
done
echo "model.pt byte-identical: $same of $n runs (logs and runs in $OUT)"

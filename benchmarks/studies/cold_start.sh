#!/bin/bash
# Cold start of `kvcore generate --max-new-tokens 1 Hello` (whole process, default model), three runs of
# each mode, interleaved: "base" = the kvcore tree in $BASE (e.g. `git archive <commit> | tar -x -C $BASE`),
# "off" = this tree with the model cache off, "hit" = this tree reading a filled cache.
# Usage: BASE=/tmp/kvcore-base benchmarks/studies/cold_start.sh   (from the repository root; prints wall and CPU seconds)
set -u
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
export KVCORE_CACHE_DIR=$(mktemp -d)
cd /tmp  # not the repository: `python -m` would put it first on sys.path and shadow $BASE
KVCORE_MODEL_CACHE=1 $PY -m kvcore.cli generate --max-new-tokens 1 "Hello" >/dev/null 2>&1  # fill the cache
for i in 1 2 3; do
  for mode in base off hit; do
    case $mode in
      base) [ -n "${BASE:-}" ] || continue; run=(env PYTHONPATH=$BASE KVCORE_MODEL_CACHE=0);;
      off) run=(env KVCORE_MODEL_CACHE=0);;
      hit) run=(env KVCORE_MODEL_CACHE=1);;
    esac
    "${run[@]}" /usr/bin/time -f "$mode %e s wall %U user %S sys" $PY -m kvcore.cli generate --max-new-tokens 1 "Hello" \
      2>&1 >/dev/null | tail -1
    echo "  load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
rm -rf "$KVCORE_CACHE_DIR"

#!/usr/bin/env bash
# `make test`: every test, as two pytest processes side by side. The Ray, vLLM and learning runs
# (marker `heavy`, set in tests/conftest.py) keep the CPUs busy; the cluster and real-pod tests
# mostly wait on the control plane and the node. One after the other they took 90 minutes on
# 2 cores; side by side each half takes about 45. Extra arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
pytest=${PYTEST:-.venv/bin/pytest}
log=$(mktemp "${TMPDIR:-/tmp}/rlkube-test-heavy.XXXXXX.log")
"$pytest" -p no:cacheprovider -m heavy "$@" tests > "$log" 2>&1 &
heavy=$!
# Interrupted (Ctrl-C, or CI's time limit): stop the background run too, never leave it behind.
trap 'kill -TERM "$heavy" 2>/dev/null; wait "$heavy"; exit 130' INT TERM
echo "[test] the heavy tests run beside these (marker heavy; their log: $log)"
"$pytest" -p no:cacheprovider -m "not heavy" "$@" tests
rest=$?
echo "[test] the heavy tests (marker heavy):"
tail -n +1 --pid="$heavy" -f "$log"
wait "$heavy"
heavy_rc=$?
echo "[test] exit codes: cluster and the rest $rest, heavy $heavy_rc"
[ "$rest" -eq 0 ] && [ "$heavy_rc" -eq 0 ]

#!/usr/bin/env bash
# The accelerator check in one command (issues 16 and 26), on a machine with a GPU:
#
#   1. the kernel conformance suite on the device (tests/test_kernels.py: cuDNN and the
#      Pallas Triton kernel natively, their adapters and through jattn.dot_product_attention
#      (implementation=NAME, and None: the automatic rule must run cuDNN), against float64
#      numpy and jattn's dense path; splash is a TPU kernel, checked in interpret mode by CI
#      on CPU, so it is left out here);
#   1b. jattn's own Pallas kernel compiled on the device (tests/test_pallas_kernel.py: every
#      option, forward, lse and gradients against the dense path and float64 numpy, with
#      JAX_DEFAULT_MATMUL_PRECISION=highest so that the dense path's float32 is exact);
#   1c. benchmarks/bench_kernels.py (issue 26's shapes, bfloat16 causal: cuDNN, the kernel
#      plain and with soft-cap, ALiBi, 4 documents, dropout 0.1, sinks, the XLA loop),
#      writing benchmarks/gpu_results.md (device name and versions; DRY_RUN: OUTDIR);
#   2. train_toy.py --platform gpu (the causal-vs-leaky table);
#   3. benchmarks/bench_accelerators.py (forward and forward+backward, float32 and bfloat16,
#      causal, T = 1k..32k, B=4 H=16 D=128: jattn.dot_product_attention(implementation=NAME)
#      for every name, None included, against jax.nn's XLA and cuDNN attention, with
#      compiled memory), given whatever time is left.
#
# Usage:
#   bash benchmarks/device_check.sh [OUTDIR]            # default OUTDIR: benchmarks/device_check
#   DRY_RUN=1 bash benchmarks/device_check.sh /tmp/dc   # tiny sizes on CPU: checks the script
#
# OUTDIR receives at most 9 files: device_check.md (what ran, exit codes, times),
# conformance.log, pallas_conformance.log, bench_kernels.log, train_toy.log, toy_summary.json,
# accelerators.md (the benchmark table), bench.log (and gpu_results.md under DRY_RUN; on a
# GPU it is written to benchmarks/gpu_results.md). The whole check stays within TOTAL_S seconds (default 480: 8 minutes on one GPU):
# every step runs under `timeout`, and the benchmark gets the time the others left (it stops
# between configurations at its budget and rewrites its table after each one, so a cut run
# still leaves a table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-benchmarks/device_check}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-480}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

if [ "${DRY_RUN:-}" = 1 ]; then
  platform=cpu
  export JATTN_PALLAS_INTERPRET=1
  pytest_args=(-k "causal_gqa or refusals")
  kernel_args=(-k "causal_against_numpy or fully_masked")
  kernel_bench_args=(--small --rounds 1 --budget-s 90 --out "$OUTDIR/gpu_results.md")
  toy_args=(--steps 20 --eval-every 10 --checkpoint-every 20)
  bench_args=(--small --lengths 128 --dtypes bfloat16)
else
  platform=gpu
  pytest_args=(-k "not splash")
  kernel_args=()
  kernel_bench_args=(--out benchmarks/gpu_results.md --budget-s 110)
  toy_args=()
  bench_args=()
fi

summary="$OUTDIR/device_check.md"
{
  echo "# Device check"
  echo
  echo "\`bash benchmarks/device_check.sh\` on $(date -u +%Y-%m-%dT%H:%MZ)$([ "${DRY_RUN:-}" = 1 ] && echo ' (DRY_RUN: CPU, tiny sizes)')."
  echo
  echo '```'
  (command -v nvidia-smi >/dev/null && nvidia-smi -L) || echo "no nvidia-smi"
  "$PY" -c 'import sys, jax; print("Python", sys.version.split()[0], "| jax", jax.__version__, "|", jax.devices())' 2>&1
  echo '```'
  echo
  echo "| step | exit | seconds |"
  echo "|---|---|---|"
} >"$summary"

step() {  # step NAME TIMEOUT LOG CMD...: runs CMD under timeout, logs it, adds a summary row
  local name=$1 limit=$2 log=$3; shift 3
  local t0; t0=$(date +%s)
  echo "== $name (limit ${limit}s, at $(elapsed)s)"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  echo "| $name | $rc$([ $rc = 124 ] && echo ' (timed out)') | $(($(date +%s) - t0)) |" >>"$summary"
  [ "$rc" = 0 ] || failed=$((failed + 1))
  return 0  # the next steps still run; the script's own exit status counts the failures
}
failed=0

step "conformance (tests/test_kernels.py ${pytest_args[*]})" 120 "$OUTDIR/conformance.log" \
  "$PY" -m pytest tests/test_kernels.py -q -rA -p no:cacheprovider "${pytest_args[@]}"

step "jattn's Pallas kernel on the device (tests/test_pallas_kernel.py ${kernel_args[*]})" 90 \
  "$OUTDIR/pallas_conformance.log" env JAX_DEFAULT_MATMUL_PRECISION=highest \
  "$PY" -m pytest tests/test_pallas_kernel.py -q -rA -p no:cacheprovider "${kernel_args[@]}"

step "bench_kernels.py (issue 26's shapes)" 150 "$OUTDIR/bench_kernels.log" \
  "$PY" benchmarks/bench_kernels.py "${kernel_bench_args[@]}"

toy_dir=$(mktemp -d)
step "train_toy.py --platform $platform" 90 "$OUTDIR/train_toy.log" \
  "$PY" train_toy.py --platform "$platform" --no-progress --out "$toy_dir/run" "${toy_args[@]}"
cp "$toy_dir/run/summary.json" "$OUTDIR/toy_summary.json" 2>/dev/null || true
rm -rf "$toy_dir"

# The benchmark gets what is left, less a margin for the configuration in flight when its
# budget runs out and for the timeout's own grace period.
left=$((TOTAL_S - $(elapsed) - 15))
[ "$left" -lt 40 ] && left=40
budget=$((left - 90))
[ "$budget" -lt 30 ] && budget=30
step "bench_accelerators.py (budget ${budget}s)" "$left" "$OUTDIR/bench.log" \
  "$PY" benchmarks/bench_accelerators.py --budget-s "$budget" --out "$OUTDIR/accelerators.md" "${bench_args[@]}"

echo >>"$summary"
echo "Total: $(elapsed) s (limit $TOTAL_S s). Logs beside this file; the benchmark table is accelerators.md." >>"$summary"
cat "$summary"
if [ "$failed" -gt 0 ]; then
  echo "device check: $failed step(s) failed (see the table above)" >&2
  exit 1
fi

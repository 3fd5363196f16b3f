#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU machine's time is short):
#   1. the CUDA tests: observation bitwise, hooks and the watch (statistics only, per_sample, compiled, AMP,
#      a device-tensor learning rate) without a host sync, a CUDA trace saved and loaded on the CPU;
#   2. benchmarks/watch_gpu.py: the watch per step against plain and the hand-written floor, with a sync check;
#   3. benchmarks/per_sample_zoo.py --device cuda: per-sample norms across the zoo against the peers.
# Results go to $OUT (set on a lent machine) or benchmarks/results. Opacus and BackPACK, where the machine lacks
# them, come from wheels in .whl/ (pip download them here; see the device tool's notes). Each part has its own
# time limit, so that one that hangs still leaves the others' results.
#   bash benchmarks/gpu.sh
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$out/gpu_tests.txt"
timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
  tests/test_saved.py::test_a_cuda_trace_loads_on_the_cpu \
  tests/test_watch.py::test_no_host_sync_per_step_on_gpu tests/test_watch.py::test_learning_rate_on_device_without_a_sync \
  tests/test_watch_amp.py::test_grad_scaler_on_gpu_without_host_sync_in_the_watch \
  tests/test_watch_compile.py::test_compiled_on_gpu_without_host_sync 2>&1 | tee -a "$out/gpu_tests.txt"
timeout "${WATCH_S:-180}" python3 -m benchmarks.watch_gpu --steps 100 --rounds 3 --out "$out" 2>&1 | tail -30
timeout "${ZOO_S:-240}" python3 -m benchmarks.per_sample_zoo --device cuda --repeats 5 --out "$out" 2>&1 \
  | tee "$out/per_sample_zoo_cuda.log" | grep -v "^|" | tail -60

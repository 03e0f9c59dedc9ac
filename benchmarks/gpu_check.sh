#!/usr/bin/env bash
# The checks that need a CUDA GPU (docs/gpu.md): the device-parametrized tests (every test whose id names "gpu"),
# then the DP step of bench_dp_step.py and the federated client part of bench_federated_round.py timed on the GPU.
#   bash benchmarks/gpu_check.sh OUTDIR        # writes OUTDIR/tests.log, OUTDIR/bench.log, OUTDIR/dp_step_*.json
#   SKIP_TESTS=1 NO_MEMORY_MODELS= MEMORY_MODELS= bash benchmarks/gpu_check.sh OUTDIR   # only the compiled pass' check
# CI has no GPU: there the GPU variants are not collected and the CPU ones run with the suite.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi -L
$py -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"
uptime
[ -z "${SKIP_TESTS:-}" ] && timeout "${TEST_TIMEOUT:-330}" $py -m pytest -q -p no:cacheprovider -rs -k gpu \
  tests/privacy/test_layer_matrix.py tests/privacy/test_noise.py tests/privacy/test_mechanisms.py \
  tests/callbacks/test_mixed_precision.py tests/callbacks/test_adaptive_clipping.py \
  tests/federated/test_dense.py tests/federated/test_dp_fedavg.py tests/federated/test_module.py \
  tests/federated/test_local_dp_sgd.py tests/federated/test_local_dp_round.py tests/federated/test_pfa.py \
  tests/models/test_adapters.py tests/models/test_language.py 2>&1 | tee "$out/tests.log"
[ -n "${SKIP_BENCH:-}" ] && exit 0
bench() {
  uptime
  timeout 60 $py benchmarks/bench_federated_round.py --model cifar --samples 47,81 --batch-size 16 --repeats 3 --device cuda
  timeout 30 $py benchmarks/bench_federated_round.py --model logreg --samples 45,82 --batch-size 16 --repeats 5 --device cuda
  for m in ${NO_MEMORY_MODELS-transformer resnet8_gn gpt2 lstm}; do
    timeout 60 $py benchmarks/bench_dp_step.py --model "$m" --rounds 10 --steps 3 --device cuda --no-memory \
      --json "$out/dp_step_$m.json"
  done
  for m in ${MEMORY_MODELS-mnist_cnn gpt2_lora}; do  # peak memory: one fresh process per method (slower)
    timeout 100 $py benchmarks/bench_dp_step.py --model "$m" --rounds 10 --steps 3 --device cuda --json "$out/dp_step_$m.json"
  done
  # the private pass compiled (DPSGD(compile_step=True), issue 53): kernel launches per step (--count-ops) against the
  # eager pass with the same padding; compilation takes tens of seconds, hence its own, longer limit
  for m in ${COMPILED_MODELS-mnist_cnn transformer}; do
    timeout 150 $py benchmarks/bench_dp_step.py --model "$m" --rounds 10 --steps 3 --device cuda --no-memory --count-ops \
      --methods nonprivate,lightning_dp_static,lightning_dp_compiled --json "$out/dp_step_compiled_$m.json"
  done
  uptime
}
export out py
timeout "${BENCH_TIMEOUT:-300}" bash -c "$(declare -f bench); bench" 2>&1 | tee "$out/bench.log"

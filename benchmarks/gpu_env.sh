# Sourced by benchmarks/run_*_gpu.sh. gpu_env SITE: the lent GPU machine has no tvm-ffi; its wheel
# travels in .whl/ (DEVICE.md) and is installed into SITE when tvm_ffi does not import. Then the
# repository goes on PYTHONPATH and the JIT cache is set; returns 2 when tvm-ffi could not be
# installed (the caller decides whether to go on without the kernels).
gpu_env() {
  local rc=0
  if ! python3 -c "import tvm_ffi" 2>/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$1" .whl/*.whl; then
      export PYTHONPATH="$1"
    else
      echo "tvm_ffi missing and .whl/ has no wheel: kernels will fail"
      rc=2
    fi
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
  export SGLANG_HISPARSE_JIT_CACHE=${SGLANG_HISPARSE_JIT_CACHE:-/tmp/hisparse_jit}
  return $rc
}

"""The CUDA runner: Qwen3.5 text decoding on one NVIDIA GPU through cuda-python (cuda.core + cuda.bindings),
hand-written kernels (kernels/*.cu, compiled by NVRTC for the device's own arch and cached on disk) and cuBLASLt
GEMMs via nvmath-python. Nothing is imported here, so that `import gpu_engine.cuda` works without a GPU; use
`gpu_engine.cuda.runner.CudaRunner` (or `gpu_engine.load(path, runner="cuda")`).

Modules: device (context, stream, NVRTC + module cache, graphs), arena (one start-up allocation, sub-allocated),
context (GpuContext + DArray), gemm (cuBLASLt), ops (typed kernel launchers), rotary (host rotary tables),
weights (fused weight upload), runner (the runner contract), bf16 (host bf16 conversion), errors.
"""

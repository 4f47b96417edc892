"""The CUDA runner: Qwen3.5 text decoding on one NVIDIA GPU through cuda-python (cuda.core + cuda.bindings),
hand-written kernels (kernels/*.cu, compiled by NVRTC for the device's own arch and cached on disk) and cuBLASLt
GEMMs via nvmath-python. Nothing is imported here, so that `import gpu_engine.cuda` works without a GPU; use
`gpu_engine.cuda.runner.CudaRunner` (or `gpu_engine.load(path, runner="cuda")`).

Modules (one line each in gpu_engine/README.md): runner (the runner contract: memory, cache, graphs, sampling),
text_model (the decoder), step (a step's tables), options (CudaOptions), weights, vision, sampler, embeddings,
ops / vision_ops / deltanet_chunked / vision_flash (kernel launchers), gemm (cuBLASLt), context, arena, device,
rotary, bf16, errors.
"""

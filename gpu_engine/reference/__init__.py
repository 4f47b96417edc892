"""numpy float32 reference runner: plain, readable, the oracle for every other runner and the CPU fallback."""

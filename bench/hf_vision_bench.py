"""transformers 5.17's Qwen3.5 vision tower on the same card and config as ours: one image's encode time.

    python3 bench/hf_vision_bench.py [--side 1024] [--json out.json] [--device cuda] [--config '{"depth": 2, ...}']

The peer for the image-encode row of bench/cuda_operator_bench.py (`--only-vision`, whose VISION_2B config this
uses by default). Random bf16 weights built on the device (no float32 copy), random pixels shaped like the
processor's output (patches of 3 x 2 x 16 x 16 values, grid 1 x side/16 x side/16), forward() timed with a device
sync, median of 5 after 2 warm-ups. transformers picks its own attention implementation (sdpa where available):
what a user without extra packages gets. Prints one JSON line; exits 0 with {"skipped": ...} without torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(config: dict, side: int, device: str, repeats: int = 5) -> dict:
    import torch
    from hf_reference_bench import born_bf16
    from transformers.models.qwen3_5 import Qwen3_5VisionConfig, Qwen3_5VisionModel

    patch = config["patch_size"]
    if side % (patch * config["spatial_merge_size"]):
        raise ValueError(f"side {side} is not a multiple of patch_size x spatial_merge_size")
    torch.manual_seed(0)
    with born_bf16(device):
        model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**config)).eval()
    grid = side // patch
    values = config["in_channels"] * config["temporal_patch_size"] * patch * patch
    pixels = torch.randn(grid * grid, values, device=device, dtype=torch.bfloat16)
    grid_thw = torch.tensor([[1, grid, grid]], device=device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    times = []
    with torch.no_grad():
        for i in range(2 + repeats):
            sync()
            t0 = time.perf_counter()
            out = model(pixels, grid_thw=grid_thw)
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    hidden = out.pooler_output if hasattr(out, "pooler_output") and out.pooler_output is not None else out[0]
    if not torch.isfinite(hidden.float()).all():
        raise RuntimeError("transformers vision tower produced non-finite values")
    times.sort()
    encode_s = times[len(times) // 2]
    result = {"side_px": side, "patches": grid * grid, "encode_ms": 1e3 * encode_s, "images_per_s": 1 / encode_s,
              "output_rows": int(hidden.shape[0]), "attn_implementation": getattr(model.config, "_attn_implementation",
                                                                                  None),
              "device": device, "torch": torch.__version__}
    if device.startswith("cuda"):
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
        result["device_name"] = torch.cuda.get_device_name()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", help="JSON vision config (default: cuda_operator_bench.VISION_2B)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401 - transformers needs it; fail here with the hint below
        import transformers
    except ImportError as exc:
        print(json.dumps({"skipped": f"torch/transformers not installed: {exc}"}))
        return 0
    if args.config:
        config = json.loads(args.config)
    else:
        from cuda_operator_bench import VISION_2B
        config = dict(VISION_2B)
    config.pop("rope_theta", None)  # ours only: transformers' vision rotary has a fixed base
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    result = {"transformers": transformers.__version__, "config": config, **measure(config, args.side, args.device)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

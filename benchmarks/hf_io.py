"""Import and export of a Hugging Face checkpoint: time and peak host memory.

    python benchmarks/hf_io.py [--layers 12] [--stage 3] [--json runs/hf_io.json]

Writes a random bf16 Llama-architecture checkpoint (GQA; ~124M parameters with the defaults) with
safetensors, then, in a fresh process per phase, loads it into a plan on 8 simulated CPU devices
(``zjax.hf.load``) and saves it back (``zjax.hf.save``). On CPU the devices' memory is this process's, so
the figure that matters is the transient: peak RSS minus the RSS before loading minus the state's bytes.
It is compared with the largest leaf of the model (fp32), which a host must hold whole when the plan
replicates that leaf.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_checkpoint(directory: Path, layers: int) -> dict:
    import ml_dtypes
    import numpy as np

    from zjax.hf._names import tensors
    from zjax.models import DecoderConfig, config_to_hf

    cfg = DecoderConfig(vocab=32000, embed=768, layers=layers, heads=12, head_dim=64, kv_heads=4, mlp=2048)
    rng = np.random.default_rng(0)
    out = {}
    for t in tensors(cfg):
        for name in t.names():
            out[name] = (rng.standard_normal(t.hf_shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    largest = max(x.size for x in out.values()) * 4
    return {
        "params": cfg.num_params,
        "largest_leaf_fp32_bytes": largest,
        "file_bytes": sum(x.nbytes for x in out.values()),
    }


def phase(ckpt: str, stage: int, out: str | None) -> dict:
    import jax

    import zjax

    jax.config.update("jax_platforms", "cpu")
    zjax.simulate_cpu_devices(8)
    import optax

    model = zjax.models.from_hf_config(ckpt)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage, precision="bf16")
    jax.devices()  # start the backend before measuring
    before = rss_bytes()
    t0 = time.perf_counter()
    state = zjax.hf.load(ckpt, plan, model, optax.adamw(1e-4))
    jax.block_until_ready(state)
    load_s = time.perf_counter() - t0
    state_bytes = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    result = {
        "load_seconds": load_s,
        "rss_before": before,
        "peak_after_load": peak_bytes(),
        "state_bytes": state_bytes,
        "load_transient_bytes": peak_bytes() - before - state_bytes,
    }
    if out is not None:
        t0 = time.perf_counter()
        zjax.hf.save(out, model, state)
        result["save_seconds"] = time.perf_counter() - t0
        result["peak_after_save"] = peak_bytes()
        result["save_transient_bytes"] = peak_bytes() - result["peak_after_load"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--phase", nargs=3, default=None, help=argparse.SUPPRESS)  # internal: ckpt stage out
    args = p.parse_args()
    if args.phase:
        ckpt, stage, out = args.phase
        print(json.dumps(phase(ckpt, int(stage), None if out == "-" else out)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        info = make_checkpoint(Path(tmp) / "ckpt", args.layers)
        cmd = [sys.executable, __file__, "--phase", str(Path(tmp) / "ckpt"), str(args.stage), str(Path(tmp) / "out")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        result = {**info, "stage": args.stage, **json.loads(proc.stdout.strip().splitlines()[-1])}
    mib = 2**20
    print(
        f"{info['params'] / 1e6:.1f}M params ({info['file_bytes'] / mib:.0f} MiB bf16), stage {args.stage}, 8 devices: "
        f"load {result['load_seconds']:.2f} s, transient {result['load_transient_bytes'] / mib:.1f} MiB "
        f"(largest leaf fp32 {info['largest_leaf_fp32_bytes'] / mib:.1f} MiB, state {result['state_bytes'] / mib:.0f} "
        f"MiB); save {result['save_seconds']:.2f} s, transient {result['save_transient_bytes'] / mib:.1f} MiB"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Per-rank memory of loading a saved model folder for an FSDP2 run: the whole model on every rank, then
``fully_shard`` (today's path for what the meta path cannot load) against the meta-device path
(``dptext.finetune.meta_load``: each rank reads only its own rows from the safetensors file).

    python benchmarks/fsdp_load_memory.py [--folder /tmp/llama400m] [--layers 24] [--out results/....json]

Builds a random Llama folder (hidden 1024, GQA 16/4, tied 32k vocabulary, ``--layers`` layers) if ``--folder`` has
none, then runs each path as 2 gloo processes, one path at a time. Per rank it reports, above the process's memory
before loading (transformers imported, process group up): the peak *anonymous* resident memory (RssAnon, sampled
every 5 ms: what the loaded tensors cost), the peak resident memory in all (VmRSS: with the file pages of the
safetensors memory maps, page cache the kernel can drop), and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_fsdp import PeakRss  # noqa: E402


def status_bytes(field: str) -> int:
    """One size of this process from /proc/self/status: RssAnon (anonymous) or VmRSS (file pages of memory maps
    included)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def anonymous_bytes() -> int:
    return status_bytes("RssAnon")


def resident_bytes() -> int:
    return status_bytes("VmRSS")


def save_folder(folder: Path, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dptext.models.tiny import tiny_tokenizer

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tiny_tokenizer("tiny-llama").save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def worker(folder: Path, path: str, out: Path) -> None:
    from types import SimpleNamespace

    import torch
    import transformers  # noqa: F401 - imported before the baseline: both paths use it

    from dptext.finetune.distributed import current, release

    ctx = current("cpu")
    before, start = {"anonymous": anonymous_bytes(), "resident": resident_bytes()}, time.monotonic()
    with PeakRss(anonymous_bytes) as anonymous, PeakRss(resident_bytes) as resident:
        if path == "meta":
            from dptext.finetune.meta_load import meta_loaded

            recipe = SimpleNamespace(model=SimpleNamespace(adaptation="full"), train=SimpleNamespace(precision="fp32"))
            meta_loaded(recipe, "causal_lm", None, folder, torch.device("cpu"), ctx)
        else:
            from dptext.finetune.sharding import shard_model
            from dptext.models.loading import load_model

            model, _ = load_model(str(folder))
            ctx.broadcast_parameters(model.train())
            shard_model(model)
        torch.distributed.barrier()
    row = {"rank": ctx.rank, "path": path, "seconds": time.monotonic() - start,
           "peak_anonymous_above_start_bytes": anonymous.peak - before["anonymous"],
           "peak_resident_above_start_bytes": resident.peak - before["resident"]}
    (out / f"{path}-rank{ctx.rank}.json").write_text(json.dumps(row))
    release()


def main() -> None:
    from two_ranks import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, default=Path("/tmp/llama400m"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fsdp_load_memory_cpu.json")
    args = parser.parse_args()
    parameters = None
    if not (args.folder / "model.safetensors").is_file():
        parameters = save_folder(args.folder, args.layers)
    rows = []
    for path in ("whole", "meta"):
        env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(args.folder), path, str(args.out.parent)],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        if any(proc.wait(timeout=900) != 0 for proc in procs):
            raise SystemExit(f"the {path} path failed")
        rows += [json.loads((args.out.parent / f"{path}-rank{r}.json").read_text()) for r in range(2)]
        for r in range(2):
            (args.out.parent / f"{path}-rank{r}.json").unlink()
    file_bytes = (args.folder / "model.safetensors").stat().st_size
    result = {"what": __doc__.splitlines()[0], "folder_bytes": file_bytes, "parameters": parameters,
              "machine": f"{os.cpu_count()}-core CPU, 2 gloo processes", "rows": rows,
              "ratio_meta_over_whole_anonymous": [
                  next(r for r in rows if r["path"] == "meta" and r["rank"] == k)["peak_anonymous_above_start_bytes"]
                  / next(r for r in rows if r["path"] == "whole" and r["rank"] == k)["peak_anonymous_above_start_bytes"]
                  for k in range(2)]}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        main()

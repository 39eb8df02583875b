"""Largest resident memory of a run started from Hugging Face weights (`fivefold train --hf`) on 4 processes under
tp 2 x pp 2 against the same run on one process, and of `fivefold export` of the 4-rank checkpoint against the
size of the fp32 model; sampled from outside the processes (`peak_rss.measure`: VmRSS of every process of the
command, every 0.1 s).

The model is the 300M-parameter untied Llama of docs/benchmarks.md's resident-memory figure (4 blocks of
smollm-1.7b, vocabulary 8192), with random weights, written by `transformers` (`LlamaForCausalLM.save_pretrained`).
Prints the peaks, their ratio (target: at most 0.36), the losses of both runs at every step (target: within 1e-4
relative) and the export's peak against the fp32 model's bytes (target: below).

    PYTHONPATH=src python benchmarks/hf_start_memory.py --work /tmp/hf-start
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

import torch
from peak_rss import describe, measure

from fivefold.flops import count_params
from fivefold.models.hf import hf_config_from_model_config
from fivefold.presets import get_preset

RUN = "--train.seq_len 64 --train.global_batch_size 4 --max-steps 3 --train.threads 1"
LAYOUT = "--nproc 4 --layout.tp 2 --layout.pp 2"


def write_model(path: Path) -> int:
    """The 300M Llama as `transformers` writes it (random weights, fp32); returns its parameter count."""
    import dataclasses

    import transformers

    cfg = dataclasses.replace(get_preset("smollm-1.7b"), n_layers=4, vocab_size=8192, tied_embeddings=False)
    hf = hf_config_from_model_config(cfg)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    model.save_pretrained(str(path))
    return count_params(cfg)


def losses(run_dir: Path) -> list[tuple[int, str, float]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in ("loss", "val_loss"):
            if key in record:
                out.append((int(record["step"]), key, float(record[key])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="hf-start-memory", help="directory for the model, the runs and the export")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    hf_dir = work / "llama-300m"
    params = write_model(hf_dir)
    fivefold = f"{shlex.quote(sys.executable)} -m fivefold"
    peaks = {}
    for name, layout in (("one", ""), ("four", LAYOUT)):
        run_dir = work / name
        command = f"{fivefold} train --hf {hf_dir} {RUN} --run-dir {run_dir} {layout}"
        overall, phases, status = measure(command, str(run_dir), echo=False)
        if status:
            print(f"{command} exited with {status}", file=sys.stderr)
            return 1
        peaks[name] = overall
        print(f"{name} process{'es' if layout else ''}: {describe(overall, phases)}")
    ratio = peaks["four"] / peaks["one"]
    print(f"largest process, 4 ranks / 1: {peaks['four'] / 1024:.1f} / {peaks['one'] / 1024:.1f} MiB = {ratio:.3f} "
          f"(target <= 0.36): {'PASS' if ratio <= 0.36 else 'FAIL'}")
    one, four = losses(work / "one"), losses(work / "four")
    worst = max(abs(a[2] - b[2]) / abs(a[2]) for a, b in zip(one, four, strict=True))
    for a, b in zip(one, four, strict=True):
        print(f"step {a[0]} {a[1]}: one process {a[2]:.6f}, tp2 x pp2 {b[2]:.6f}")
    print(f"largest relative difference of the losses: {worst:.2e} (target <= 1e-4): "
          f"{'PASS' if worst <= 1e-4 and [a[:2] for a in one] == [b[:2] for b in four] else 'FAIL'}")

    export = work / "exported"
    command = f"{fivefold} export --checkpoint {work / 'four'} --hf {export}"
    overall, _, status = measure(command, echo=False)
    if status:
        print(f"{command} exited with {status}", file=sys.stderr)
        return 1
    model_bytes = params * 4
    print(f"export of the 4-rank checkpoint: peak VmRSS {overall / 1024:.1f} MiB against the fp32 model's "
          f"{model_bytes / 2**20:.1f} MiB ({params:,} parameters): {overall * 1024 / model_bytes:.3f} of it "
          f"(target < 1): {'PASS' if overall * 1024 < model_bytes else 'FAIL'}")
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

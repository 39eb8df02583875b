#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one command: fivefold's step on the Llama-3.2-1B shape at sequence
# 4096 over micro-batch sizes, with and without torch.compile, the profiler's top kernels, and the side-by-side
# with a plain transformers loop. Writes JSON lines to OUT_DIR/results.jsonl and prints a table at the end.
#   bash benchmarks/gpu_suite.sh [OUT_DIR] [MICRO_BATCHES]     (defaults: ./gpu-results, "1 2 4")
# Environment: MODEL, SEQ, STEPS, GRAD_ACCUM (micro-batches per optimizer step for the best micro-batch's
# extra run, default 4), SIDE_MB (micro-batch of the side-by-side, default 2: the transformers loop
# materialises fp32 logits and runs out of memory at 4 on 80 GB).
set -uo pipefail
out=${1:-gpu-results}
mbs_list=${2:-"1 2 4"}
model=${MODEL:-llama-3.2-1b}
seq=${SEQ:-4096}
steps=${STEPS:-10}
accum=${GRAD_ACCUM:-4}
side_mb=${SIDE_MB:-2}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
for mb in $mbs_list; do
  echo "== bench $model seq $seq micro-batch $mb compile"
  timeout 240 python -m fivefold bench --model "$model" --seq-len "$seq" --micro-batch "$mb" --steps "$steps" \
    --warmup 3 --compile --json ${BENCH_EXTRA:-} >> "$out/results.jsonl" || echo "micro-batch $mb failed ($?)"
done
best=$(python - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(max(rows, key=lambda r: r["tokens_per_s"])["micro_batch"] if rows else 1)
PY
)
echo "== best micro-batch $best: profile, eager, side by side"
timeout 240 python -m fivefold bench --model "$model" --seq-len "$seq" --micro-batch "$best" --steps 3 --warmup 3 \
  --compile --profile 2 --trace "$out/trace.json" ${BENCH_EXTRA:-} | tee "$out/profile.txt"
timeout 240 python -m fivefold bench --model "$model" --seq-len "$seq" --micro-batch "$best" --grad-accum "$accum" \
  --steps "$steps" --warmup 2 --compile --json ${BENCH_EXTRA:-} >> "$out/results.jsonl" || echo "accumulation failed"
timeout 200 python -m fivefold bench --model "$model" --seq-len "$seq" --micro-batch "$best" --steps "$steps" \
  --warmup 3 --json >> "$out/results.jsonl" || echo "eager failed"
timeout 300 python benchmarks/hf_side_by_side.py --model "$model" --seq-len "$seq" --micro-batch "$side_mb" \
  --steps "$steps" --warmup 3 --compile --json | tee -a "$out/side_by_side.jsonl"
python - "$out/results.jsonl" <<'PY'
import json, sys
print(f"{'mb':>3} {'ga':>3} {'compile':>7} {'tok/s':>9} {'MFU':>6} {'step ms':>8} {'peak GiB':>8}  split ms (fwd/bwd/opt)")
for l in open(sys.argv[1]):
    if not l.startswith("{"):
        continue
    r = json.loads(l)
    s = r["time_split_s"]
    print(f"{r['micro_batch']:>3} {r['grad_accum']:>3} {str(r['compile']):>7} {r['tokens_per_s']:>9.0f} {100 * (r['mfu'] or 0):>5.1f}% "
          f"{1e3 * r['step_time_s']:>8.1f} {(r['peak_memory_allocated_bytes'] or 0) / 2**30:>8.2f}  "
          f"{1e3 * s['forward']:.0f}/{1e3 * s['backward']:.0f}/{1e3 * s['optimizer']:.0f}")
PY

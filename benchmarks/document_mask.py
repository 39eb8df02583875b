"""Document masking against causal attention: step time, the attention work each executes, and the balance of
the zig-zag context-parallel split under document masking.

1. Step time (forward + backward, median of --repeats after one warm-up) of a small Llama at --seq tokens per
   row, fp32, on this machine's device, with `model.attn_mask = "causal"` (SDPA's causal kernel) and
   `"document"` (one causal SDPA call per document) on the same packed rows, whose documents have geometric
   lengths of mean --doc. The attention work is counted in query-key pairs (the causal kernel skips the tiles
   above the diagonal, so causal executes seq(seq+1)/2 per row; document masking sum(len(len+1)/2)), and as
   attention FLOPs (4 x pairs x head_dim x heads x layers, forward).
2. `--flex`: the forward of one attention layer through FlexAttention with a block mask built once, beside the
   variable-length calls (FlexAttention has no backward on CPU, so it cannot train there).
3. Context-parallel balance: per cp rank, the query-key pairs it computes over the ring (`parallel.context.
   ring_work`), largest and smallest, for windows of the bundled corpus (ten plays of about 40k tokens) and for a
   long-document mix, against the even share (total / cp).

    python benchmarks/document_mask.py                 # seq 2048, mean document 256, cp 2 4 8
    python benchmarks/document_mask.py --dry           # tiny sizes (a test runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fivefold.config import ModelConfig
from fivefold.flops import causal_pairs
from fivefold.models.llama import build_model
from fivefold.models.masking import DocumentMask, document_attention, document_positions
from fivefold.parallel.context import ring_work

EOS = 1


def geometric(mean: float, n: int, g: torch.Generator) -> torch.Tensor:
    """`n` lengths >= 1 with a geometric distribution of mean `mean` (inverse CDF, from the generator `g`)."""
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp(min=1e-12)
    return (u.log() / torch.log1p(torch.tensor(-1.0 / mean, dtype=torch.float64))).ceil().clamp(min=1).long()


def packed_rows(rows: int, seq: int, mean_doc: float, vocab: int, seed: int = 0) -> torch.Tensor:
    """[rows, seq] tokens of rows * seq / mean_doc documents with geometric lengths (at least one token), scaled
    to fill the rows exactly (so that they average `mean_doc` tokens), each ended by EOS; the rows cut the stream
    regardless of documents."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(rows * seq / mean_doc))
    scaled = geometric(mean_doc, n, g).double() * rows * seq / (n * mean_doc)
    ends = scaled.cumsum(0).round().long().clamp(max=rows * seq).unique()
    ends = ends[ends > 0] - 1
    tokens = torch.randint(2, vocab, (rows * seq,), generator=g)
    tokens[ends] = EOS
    return tokens.view(rows, seq)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def step_seconds(model, tokens: torch.Tensor, positions: torch.Tensor | None, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        synchronize(tokens.device)
        start = time.perf_counter()
        model(tokens, positions).float().logsumexp(-1).mean().backward()
        synchronize(tokens.device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_steps(args: argparse.Namespace) -> dict:
    cfg = ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, n_kv_heads=args.heads // 2,
                      ffn=3 * args.hidden, vocab_size=2048, max_seq_len=args.seq)
    tokens = packed_rows(args.rows, args.seq, args.doc, cfg.vocab_size).to(args.device)
    positions = document_positions(tokens, EOS)
    mask = DocumentMask(positions)
    docs = sum(len(r) for r in mask.documents)
    causal_total = args.rows * causal_pairs(args.seq)
    doc_pairs = sum(causal_pairs(stop - start) for row in mask.documents for start, stop in row)
    flops = 4 * cfg.head_dim * cfg.n_heads * cfg.n_layers  # forward attention FLOPs per query-key pair
    print(f"model: {cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} heads; {args.rows} x {args.seq} tokens, "
          f"{docs} document pieces (mean {args.rows * args.seq / docs:.0f} tokens); fp32 on {args.device}, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"{'variant':<10} {'step s':>8} {'pairs':>14} {'fraction':>9} {'attn GFLOP fwd':>15}")
    result = {"seq": args.seq, "rows": args.rows, "mean_document": args.rows * args.seq / docs}
    for name, attn_mask, pos, pairs in (("causal", "causal", None, causal_total),
                                        ("document", "document", positions, doc_pairs)):
        model = build_model(ModelConfig(**{**vars(cfg), "attn_mask": attn_mask}), args.device, seed=0)
        seconds = step_seconds(model, tokens, pos, args.repeats)
        print(f"{name:<10} {seconds:8.3f} {pairs:14,d} {pairs / causal_total:9.3f} {pairs * flops / 1e9:15.2f}")
        result[name] = {"step_time_s": seconds, "attention_pairs": pairs,
                        "attention_gflop_forward": pairs * flops / 1e9}
    return result


def time_flex(args: argparse.Namespace) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens = packed_rows(args.rows, args.seq, args.doc, 2048).to(args.device)
    positions = document_positions(tokens, EOS)
    index = torch.arange(args.seq, device=args.device)
    doc_start = index - positions  # [rows, seq]

    def same_document(b, h, q, k):
        return (k <= q) & (k >= doc_start[b, q])

    d = args.hidden // args.heads
    q = torch.randn(args.rows, args.heads, args.seq, d, device=args.device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    start = time.perf_counter()
    block_mask = create_block_mask(same_document, args.rows, None, args.seq, args.seq, device=args.device.type)
    build = time.perf_counter() - start
    mask = DocumentMask(positions)
    variants = (("varlen SDPA", lambda: document_attention(q, k, v, mask)),
                ("flex eager", lambda: flex_attention(q, k, v, block_mask=block_mask)),
                ("flex compiled", lambda: torch.compile(flex_attention)(q, k, v, block_mask=block_mask)))
    print(f"one attention layer forward, {args.rows} x {args.seq}, {args.heads} heads of {d}; block mask built in "
          f"{build:.3f} s, {block_mask.sparsity():.1f} % of its blocks skipped")
    for name, fn in variants:
        fn()
        times = []
        for _ in range(args.repeats):
            synchronize(args.device)
            start = time.perf_counter()
            fn()
            synchronize(args.device)
            times.append(time.perf_counter() - start)
        print(f"  {name:<14} {statistics.median(times):.4f} s")


def corpus_windows(seq: int, rows: int) -> torch.Tensor:
    """Document positions of `rows` training windows of the bundled corpus (prepared into the cache on first use)."""
    from fivefold.data import BatchSampler, TokenDataset, ensure_builtin_dataset

    data = TokenDataset(ensure_builtin_dataset(), "train")
    inputs, _ = BatchSampler(data, seq, rows, seed=0).global_batch(0)
    return document_positions(inputs, data.eos_id)


def long_mix_windows(seq: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Document positions of windows cut from a stream where 70 % of documents are short (geometric, mean 300
    tokens) and 30 % long (uniform 4k to 64k tokens): most tokens sit in long documents, most boundaries in
    short ones."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < rows * seq:
        if torch.rand(1, generator=g).item() < 0.7:
            lengths.append(int(geometric(300, 1, g)))
        else:
            lengths.append(int(torch.randint(4096, 65536, (1,), generator=g)))
    stream = torch.full((sum(lengths),), 2)
    stream[torch.tensor(lengths).cumsum(0) - 1] = EOS
    return document_positions(stream[:rows * seq].view(rows, seq), EOS)


def balance(args: argparse.Namespace) -> None:
    print("context parallel (zig-zag), query-key pairs per rank over the ring: largest / smallest / even share")
    for name, positions in (("bundled corpus", corpus_windows(args.seq, args.balance_rows)),
                            ("long-document mix", long_mix_windows(args.long_seq, args.balance_rows))):
        docs = int((positions == 0).sum())
        print(f"  {name}: {positions.shape[0]} windows of {positions.shape[1]} tokens, {docs} document pieces")
        for cp in args.cps:
            for label, causal in (("causal", True), ("document", False)):
                work = ring_work(positions, cp, causal=causal)
                even = sum(work) / cp
                print(f"    cp {cp} {label:<9} max {max(work):>14,d}  min {min(work):>14,d}  even {even:>16,.0f}  "
                      f"max/even {max(work) / even:.3f}  min/even {min(work) / even:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc", type=float, default=256.0, help="mean document length in tokens")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--long-seq", type=int, default=32768, help="window of the long-document mix")
    p.add_argument("--balance-rows", type=int, default=64)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: on a shared machine more threads time the OpenMP barriers)")
    p.add_argument("--flex", action="store_true", help="also time one layer's forward through FlexAttention")
    p.add_argument("--device", help="default: the accelerator if there is one, else cpu")
    p.add_argument("--json", action="store_true", help="also print the step times and work as one JSON line")
    p.add_argument("--dry", action="store_true", help="tiny sizes: a check that the script runs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    args.device = torch.device(args.device or (accelerator.type if accelerator is not None else "cpu"))
    if args.dry:
        args.seq, args.doc, args.layers, args.hidden, args.heads, args.repeats = 128, 16.0, 1, 32, 2, 1
        args.cps, args.long_seq, args.balance_rows = [2], 256, 2
    result = time_steps(args)
    if args.flex:
        time_flex(args)
    balance(args)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The state digest's cost per step against the training step it rides on, at several model sizes.

    python bench/digest.py [--sizes tiny 27m 110m] [--every 10] [--steps 6]

One process, one rank holding the whole model (a shard group of 1: the worst case for the
ratio; with FSDP over S ranks a rank digests 1/S of the state while its step still computes
the whole model for its batch). Per size: the median of ``--steps`` training steps (forward,
backward, AdamW; micro-batch 4 x 128 tokens, the tiny recipe's), then the digest of the state
after the update as the commit vote takes it (parameters and AdamW state, one part in
``--every`` per vote: the mean over a full round of parts), and the whole state at once
(``every=1``) for the 1/N scaling. Ratios are what to read: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckless_lightning.models import Llama3, Llama3Config, init_weights
from ckless_lightning.recovery.digest import StateDigest

# name -> (dim, n_layers, n_heads, ffn_dim); vocab and kv heads of the tiny recipe
SIZES = {
    "tiny": (128, 4, 4, 384),
    "27m": (512, 6, 8, 1536),
    "110m": (1024, 8, 16, 3072),
}
VOCAB, SEQ, BATCH = 2048, 128, 4


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters and their optimizer state, as the vote digests them (tensors only)."""
    tensors = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return tensors


def measure(name: str, every: int, steps: int) -> dict[str, float]:
    dim, layers, heads, ffn = SIZES[name]
    cfg = Llama3Config(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, vocab_size=VOCAB, ffn_dim=ffn
    )
    torch.manual_seed(0)
    model = Llama3(cfg)
    init_weights(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    step_s = []
    for _ in range(steps + 1):  # the first step allocates the optimizer state: not counted
        start = time.perf_counter()
        out = model(tokens[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    state = state_of(model, optimizer)
    parts, whole = StateDigest(every), StateDigest(1)
    for step in range(2 * every):  # two rounds; the first warms caches
        parts.of(state, step)
    parts.seconds = 0.0
    for step in range(every):
        parts.of(state, step)
    for _ in range(3):
        whole.of(state, 0)
    # A generation's first vote: the rank left the last generation (release) and digests again.
    # Baseline in the same run: the same vote plus the other parts' views, which the first vote
    # made too before views were made per part (what a first vote cost then).
    first, before = [], []
    for _ in range(3):
        parts.release()
        start = time.perf_counter()
        parts.of(state, 3 % every)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        for part in range(every):
            parts._part_views(parts._bytes, part)  # the old first vote's extra work
        before.append(first[-1] + time.perf_counter() - start)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state_mb": sum(t.numel() * t.element_size() for t in state) / 1e6,
        "step_s": statistics.median(step_s[1:]),
        "digest_s": parts.seconds / every,
        "whole_s": whole.seconds / 3,
        "tensors": len(state),
        "first_s": statistics.median(first),
        "before_s": statistics.median(before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--every", type=int, default=10, help="replication.digest_every")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a rank's share of this 2-core machine
    header = (
        "size",
        "params",
        "state MB",
        "step s",
        "digest ms",
        "of step",
        "whole ms",
        "tensors",
        "1st vote ms",
        "before ms",
    )
    widths = (6, 12, 9, 8, 10, 8, 9, 8, 12, 10)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for name in args.sizes:
        r = measure(name, args.every, args.steps)
        print(
            f"{name:>6} {r['params']:>12,} {r['state_mb']:>9.1f} {r['step_s']:>8.3f} "
            f"{1e3 * r['digest_s']:>10.3f} {100 * r['digest_s'] / r['step_s']:>7.2f}% "
            f"{1e3 * r['whole_s']:>9.2f} {r['tensors']:>8} "
            f"{1e3 * r['first_s']:>12.2f} {1e3 * r['before_s']:>10.2f}",
            flush=True,
        )
    print(
        f"\ndigest ms: one vote's digest at replication.digest_every={args.every} (1/{args.every} of every "
        "tensor); whole ms: all of it at once (every=1); of step: digest / the training step it rides on "
        "(1 process, torch.set_num_threads(1))."
        f"\n1st vote ms: a generation's first vote (after the rank left the last one), its own part's views "
        f"made on the way; before ms: the same plus every part's views, what a first vote cost when it made "
        f"all {args.every} parts' at once (medians of 3)."
    )


if __name__ == "__main__":
    main()

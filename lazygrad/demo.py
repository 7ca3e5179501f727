"""`python -m lazygrad.demo`: train the BERT-shaped model with a changing loss composition.

Most steps use the pre-training loss alone; every 5th step also pulls on the MLM scores
(`loss + scores.sum()` style), every 7th only trains the NSP head. Each composition is a grad
mask; the statistics at the end show one pair of graphs per mask (built at the first backward
that used it, in seconds) and hits for the rest.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import lazygrad
from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch


def composition(step: int) -> str:
    if step % 7 == 6:
        return "nsp only"
    if step % 5 == 4:
        return "loss + scores"
    return "loss"


def step_loss(outputs: tuple[torch.Tensor, ...], kind: str) -> torch.Tensor:
    loss, scores, nsp = outputs
    if kind == "nsp only":
        return nsp.logsumexp(-1).mean()
    if kind == "loss + scores":
        return loss + 1e-4 * scores.pow(2).mean()
    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--policy", default="predict", choices=["predict", "all", "recompute"])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = BertConfig(vocab=2000, hidden=128, layers=2, heads=4)
    eager = BertPretraining(config)
    # A short demo waits for each build, so its steps show the graphs in use; by default a
    # step that needs new graphs runs eagerly while they build in the background.
    model = lazygrad.lazy(copy.deepcopy(eager), policy=args.policy, wait_for_builds=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    batches = [bert_batch(config, batch=8, seq=32, seed=s) for s in range(4)]

    print(f"lazygrad demo: BERT-shaped model, {args.steps} steps, policy={args.policy!r}")
    timings = {"eager": 0.0, "lazygrad": 0.0}
    for step in range(args.steps):
        kind = composition(step)
        batch = batches[step % len(batches)]
        losses = []
        for name, net, optimizer in zip(timings, (eager, model), optimizers):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = step_loss(net(*batch), kind)
            loss.backward()
            optimizer.step()
            timings[name] += time.perf_counter() - started
            losses.append(loss.item())
        if step % 6 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  {kind:<14} loss eager {losses[0]:.4f}  lazy {losses[1]:.4f}")
    stats = lazygrad.stats(model)
    print(
        f"\ntime for {args.steps} steps: eager {timings['eager']:.2f} s, "
        f"lazygrad {timings['lazygrad']:.2f} s, which includes {stats.eager_steps} eager "
        f"step(s), {stats.builds} graph build(s) (trace, export and check per mask) and "
        f"{stats.disk_hits} pair(s) served from the disk cache"
    )
    drift = max(
        (p - q).abs().max().item() for p, q in zip(eager.parameters(), model.parameters())
    )
    print(f"largest parameter difference, eager vs lazygrad, after training: {drift:.2e}")
    print("\ncache statistics (lazygrad.stats(model)):")
    print(stats)


if __name__ == "__main__":
    main()

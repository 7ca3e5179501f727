"""Hugging Face models of four families against eager (`python -m benchmarks.families`).

The BERT-shaped workloads of `benchmarks/workloads.py` have neither rotary embeddings, nor patch
embeddings, nor experts whose weights are one stacked parameter; a Llama (RoPE: slices of every
layer's queries and keys, whose gradients are one Pad each, `lowerings.slice_as_pad`), a ViT (a
convolution whose windows tile the image, `lowerings._patch_gradients`), and a Mixtral and an
OLMoE (transformers' default experts: each expert's slice of the stacked weights fed to ORT
uncopied, each block of their gradients written in place, `capture/stacked_io.py`) have. All
from configs of a small real size (random weights, no download), trained on their own loss
(with the router's auxiliary loss for the MoE models): per model, the forward and the backward
of a steady step (median over rounds, lazygrad and eager interleaved, which goes first
alternating), the step's ratio to eager's (median of per-round ratios) and the fallbacks and
breaks, which must be 0.
Needs the `hf` extra.
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import lazygrad

RESULTS = Path(__file__).parent / "results" / "families.md"
WARMUP, ROUNDS = 3, 16


def _llama() -> tuple[torch.nn.Module, dict]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, use_cache=False)
    ids = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _vit() -> tuple[torch.nn.Module, dict]:
    import transformers

    config = transformers.ViTConfig(
        image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=2,
        num_attention_heads=3, intermediate_size=768, num_labels=10)
    generator = torch.Generator().manual_seed(0)
    return transformers.ViTForImageClassification(config), {
        "pixel_values": torch.randn(8, 3, 224, 224, generator=generator),
        "labels": torch.randint(0, 10, (8,), generator=generator)}


def _mixtral() -> tuple[torch.nn.Module, dict]:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, output_router_logits=True, use_cache=False)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return transformers.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def _olmoe() -> tuple[torch.nn.Module, dict]:
    import transformers

    config = transformers.OlmoeConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, num_experts=16, num_experts_per_tok=4,
        output_router_logits=True, use_cache=False)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return transformers.OlmoeForCausalLM(config), {"input_ids": ids, "labels": ids}


MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, dict]]]] = {
    "llama": ("hidden 512, 4 layers, vocabulary 8000, batch 8 x 128", _llama),
    "vit": ("224 px, 16 x 16 patches, hidden 192, 2 layers, batch 8", _vit),
    "mixtral": ("hidden 512, 2 layers, 8 experts of 1024 (top 2), batch 4 x 64", _mixtral),
    "olmoe": ("hidden 512, 2 layers, 16 experts of 512 (top 4), batch 4 x 64", _olmoe),
}


def _step(model: torch.nn.Module, batch: dict) -> tuple[float, float]:
    """(forward, backward) seconds of one step on the model's own loss."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    loss = model(**batch).loss
    forward = time.perf_counter()
    loss.backward()
    return forward - started, time.perf_counter() - forward


def measure(name: str) -> tuple[lazygrad.Stats, dict[str, float]]:
    torch.manual_seed(0)
    eager, batch = MODELS[name][1]()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for _ in range(WARMUP):
        _step(lazy, batch)
        _step(eager, batch)
    times: dict[str, list[tuple[float, float]]] = {"lazy": [], "eager": []}
    for round_ in range(ROUNDS):
        order = ("lazy", "eager") if round_ % 2 else ("eager", "lazy")
        for peer in order:
            times[peer].append(_step(lazy if peer == "lazy" else eager, batch))
    figures = {f"{peer} {part}": statistics.median(t[index] for t in times[peer]) * 1e3
               for peer in times for index, part in enumerate(("forward", "backward"))}
    figures["x eager"] = statistics.median(
        sum(mine) / sum(theirs) for mine, theirs in zip(times["lazy"], times["eager"]))
    return lazygrad.stats(lazy), figures


def main() -> int:
    warnings.simplefilter("ignore")
    import transformers

    load_at_start = os.getloadavg()[0]
    lines = [
        "# Hugging Face families against eager",
        "",
        f"`python -m benchmarks.families`, {datetime.date.today()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}: {WARMUP} warm-up steps (builds waited "
        f"for), then {ROUNDS} rounds interleaved with eager; ms are medians.",
        "",
        "| model | config | forward ms (eager) | backward ms (eager) | x eager | fallbacks "
        "| breaks |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (config, _) in MODELS.items():
        stats, f = measure(name)
        lines.append(
            f"| {name} | {config} | {f['lazy forward']:.1f} ({f['eager forward']:.1f}) | "
            f"{f['lazy backward']:.1f} ({f['eager backward']:.1f}) | {f['x eager']:.2f} | "
            f"{stats.fallbacks} | {stats.breaks} |")
        print(lines[-1], flush=True)
    lines[2] += (f" Load average (1 min, shared 2-core machine): {load_at_start:.1f} at the "
                 f"start, {os.getloadavg()[0]:.1f} at the end.")
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of a Mixture-of-Experts LM runs through ONNX Runtime (`python -m benchmarks.coverage`).

Hugging Face MoE LMs from small configs (random weights, no download): Mixtral and OLMoE with
transformers' default experts implementation (its `grouped_mm` op, translated by
`lazygrad/capture/grouped_mm.py`), and Mixtral with `batched_mm` experts (each token's expert
weights gathered). All three are captured whole. Per model: the share of the forward+backward
wall time spent inside ORT's runs (`lazygrad.stats(model).ort_share`, measured around each run), the
steady step against eager (interleaved, median of per-round ratios), the graphs per part, and
the reasons. The router's auxiliary loss joins every third step. Needs the `hf` extra.
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import lazygrad

RESULTS = Path(__file__).parent / "results" / "coverage.md"
WARMUP, STEPS = 6, 48  # steps of 30-40 ms: 18 gave ratios from 0.83 to 1.77 on one model


def _model(kind: str, experts: str | None) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        num_experts_per_tok=2, output_router_logits=True, use_cache=False,
    )
    if kind == "olmoe":
        config = transformers.OlmoeConfig(num_experts=8, **common)
        model_class = transformers.OlmoeForCausalLM
    else:
        config = transformers.MixtralConfig(num_local_experts=8, **common)
        model_class = transformers.MixtralForCausalLM
    if experts is not None:
        config._experts_implementation = experts
    return model_class(config)


def _step(model: torch.nn.Module, ids: torch.Tensor, index: int) -> float:
    started = time.perf_counter()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    loss = out.loss if index % 3 == 2 else out.logits.logsumexp(-1).mean()  # aux every 3rd
    loss.backward()
    return time.perf_counter() - started


def measure(kind: str, experts: str | None) -> tuple[str, lazygrad.Stats, float]:
    eager = _model(kind, experts)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    for index in range(WARMUP):
        _step(lazy, ids, index)
        _step(eager, ids, index)
    lazygrad.reset_stats(lazy)
    ratios = []
    for index in range(WARMUP, WARMUP + STEPS):
        first, second = (lazy, eager) if index % 2 else (eager, lazy)
        times = {id(first): _step(first, ids, index), id(second): _step(second, ids, index)}
        ratios.append(times[id(lazy)] / times[id(eager)])
    name = f"{kind} ({experts or 'default'} experts)"
    return name, lazygrad.stats(lazy), statistics.median(ratios)


def main() -> int:
    warnings.simplefilter("ignore")
    import transformers

    lines = [
        "# How much of an MoE LM runs through ONNX Runtime",
        "",
        f"`python -m benchmarks.coverage`, {datetime.date.today()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}. 2 layers, hidden 128, 8 experts (top 2), "
        f"vocabulary 1000, batch 4 x 64; auxiliary loss every third step; {WARMUP} warm-up "
        f"steps (builds waited for), then {STEPS} steps interleaved with eager.",
        "",
        "| model | inside ORT | x eager | parts | graphs | modules whose own code runs eagerly |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    details = []
    load_at_start = os.getloadavg()[0]
    for kind, experts in (("mixtral", None), ("olmoe", None), ("mixtral", "batched_mm")):
        name, stats, ratio = measure(kind, experts)
        parts = stats.parts.values()
        graphs = len(stats.entries) + sum(len(p.entries) for p in parts)
        eager = bool(stats.reasons) + sum(bool(p.reasons) for p in parts)  # broke or fell back
        lines.append(f"| {name} | {stats.ort_share:.0%} | {ratio:.2f} | {len(stats.parts)} | "
                     f"{graphs} | {eager} |")
        details += ["", f"## {name}", "", "```", str(stats), "```"]
        print(lines[-1], flush=True)
    lines[2] += (f" Load average (1 min, shared 2-core machine): {load_at_start:.1f} at the "
                 f"start, {os.getloadavg()[0]:.1f} at the end.")
    RESULTS.write_text("\n".join(lines + details) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

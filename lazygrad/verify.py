"""Every newly built pair of graphs is checked once, against its own FX graphs run in torch.

The exporter's translations are not PyTorch: a translation bug (torchlib once made
`nll_loss_forward`'s total_weight a constant, and gradients came out 32x too large) would train
silently wrong. So before a pair serves a step, its forward and backward run in ONNX Runtime
and, as FX graphs, in torch, on the call's real inputs (and the step's real cotangents where
known); a mismatch raises, and the runtime falls back with the reason. A backward cut into
segments is checked as it runs: segment after segment, against the whole FX backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lazygrad.capture import Captured, Feed
from lazygrad.graph_pair import GraphPair


class VerificationError(RuntimeError):
    """The ONNX graphs do not compute what their FX graphs compute."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(relative to the largest magnitude, absolute): ORT and torch reduce in different orders,
    and a value that is zero in exact arithmetic (the gradient of a bias before a BatchNorm)
    comes out as rounding noise in both."""
    return (1e-2, 1e-3) if dtype in (torch.float16, torch.bfloat16) else (1e-3, 1e-5)


def verify(
    captured: Captured,
    pair: GraphPair,
    primals: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor | None] | None,
    device: torch.device,
) -> None:
    """Raise VerificationError unless ORT's results equal the FX graphs' on these inputs."""
    tidy = captured.tidy
    primals = [p.detach() for p in primals]
    env = pair.sizes(primals)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        draws = pair.draw(env, device)
    values: dict[str, Sequence] = {"primal": primals, "random": draws}
    with torch.no_grad():
        expected = list(tidy.forward(*_feeds(tidy.forward_feeds, values)))
    # ORT's results are compared, and dropped, one by one: the backward is fed torch's.
    _compare(pair.forward(primals, draws, device), expected, "forward result")
    if tidy.backward is None or pair.mask is None:
        return
    outputs = pair.outputs(expected, env)
    if cotangents is None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            cotangents = [torch.randn_like(o) if o.is_floating_point() else None for o in outputs]
    cotangents = [
        (c.detach() if c is not None else torch.zeros_like(o)) if bit else None
        for c, o, bit in zip(cotangents, outputs, pair.mask)
    ]
    # Only what the backward reads stays (a big output the mask leaves out, logits, goes now).
    read = set(pair.outputs_read_by_backward)
    del outputs
    expected = [tensor if index in read else None for index, tensor in enumerate(expected)]
    values = {**values, "saved": expected, "cotangent": cotangents}
    with torch.no_grad():
        expected_grads = list(tidy.backward(*_feeds(tidy.backward_feeds, values)))
    grads = pair.backward(primals, draws, expected, cotangents, device)
    del values, expected
    _compare([grads[i] for i in pair.graphs.grads_for], expected_grads, "gradient")


def _feeds(feeds: list[Feed], values: dict[str, Sequence]) -> list[torch.Tensor]:
    return [values[feed.kind][feed.index] for feed in feeds]


def _compare(got: list, expected: Sequence, what: str) -> None:
    """Raise unless each of `got` (ORT's) equals `expected` (torch's) within `tolerance`; each
    of `got` is dropped once compared."""
    if len(got) != len(expected):
        raise VerificationError(f"{len(got)} {what}s from ORT, {len(expected)} from torch")
    for index, wanted in enumerate(expected):
        actual, got[index] = got[index], None
        if not isinstance(wanted, torch.Tensor):
            continue
        if actual.shape != wanted.shape or actual.dtype != wanted.dtype:
            raise VerificationError(
                f"{what} {index}: ORT gives {actual.dtype}{list(actual.shape)}, torch "
                f"{wanted.dtype}{list(wanted.shape)}"
            )
        if not wanted.is_floating_point():
            if not torch.equal(actual, wanted):
                raise VerificationError(f"{what} {index}: ORT and torch differ")
            continue
        error, scale, same_nans = _difference(actual, wanted)
        relative, absolute = tolerance(wanted.dtype)
        if not same_nans or error > relative * scale + absolute:
            raise VerificationError(
                f"{what} {index}: ORT differs from torch by {error:.3g} (largest magnitude "
                f"{scale:.3g})"
            )


_BLOCK = 1 << 20  # elements compared at once: a logits-sized result makes no full-size temporary


def _difference(actual: torch.Tensor, wanted: torch.Tensor) -> tuple[float, float, bool]:
    """(largest |actual - wanted| where neither is NaN, largest finite |wanted|, NaNs at the
    same places), a block at a time."""
    actual, wanted = actual.reshape(-1), wanted.reshape(-1)
    error, scale, same_nans = 0.0, 0.0, True
    for start in range(0, wanted.numel(), _BLOCK):
        got, want = actual[start:start + _BLOCK], wanted[start:start + _BLOCK]
        same_nans = same_nans and torch.isnan(got).equal(torch.isnan(want))
        differences = (got - want).abs_().nan_to_num_(nan=0.0, posinf=float("inf"))
        error = max(error, differences.max().item())
        scale = max(scale, want.abs().nan_to_num_(nan=0.0, posinf=0.0).max().item())
    return error, scale, same_nans

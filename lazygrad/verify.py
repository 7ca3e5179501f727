"""Every newly built pair of graphs is checked once, against its own FX graphs run in torch.

The exporter's translations are not PyTorch: a translation bug (torchlib once made
`nll_loss_forward`'s total_weight a constant, and gradients came out 32x too large) would train
silently wrong. So before a pair serves a step, its forward and backward run in ONNX Runtime
and, as FX graphs, in torch, on the call's real inputs (and the step's real cotangents where
known); a mismatch raises, and the runtime falls back with the reason.

A float result passes when it is within a fixed tolerance of torch's, or, failing that, when
it is about as close to exact as torch's own float32 result is: the FX graph is run again in
float64 on the same inputs (upcast), and ORT's distance to that is held against torch's. A
gradient that is a small difference of large terms (a router's weight, through a softmax and
a top-k) came out 3.5e-5 from torch's while its largest magnitude was 6e-4, over the fixed
tolerance; torch's float32 result itself was that far from float64's. A translation bug errs
by the size of the values, orders of magnitude beyond rounding, and still fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    got = pair.forward(primals, draws, device)
    _compare(got, expected, "forward result",
             lambda: _in_float64(tidy.forward, tidy.forward_feeds, values))
    del got  # ORT's copies of the forward results: the backward is fed torch's
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
    values = {**values, "saved": expected, "cotangent": cotangents}
    with torch.no_grad():
        expected_grads = list(tidy.backward(*_feeds(tidy.backward_feeds, values)))
    grads = pair.backward(primals, draws, expected, cotangents, device)
    _compare([grads[i] for i in pair.graphs.grads_for], expected_grads, "gradient",
             lambda: _in_float64(tidy.backward, tidy.backward_feeds, values))


def _feeds(feeds: list[Feed], values: dict[str, Sequence]) -> list[torch.Tensor]:
    return [values[feed.kind][feed.index] for feed in feeds]


def _compare(
    got: Sequence, expected: Sequence, what: str, exact: Callable[[], list | None]
) -> None:
    """Raise unless each of `got` (ORT's) equals `expected` (torch's), within the fixed
    tolerance or within torch's own rounding against `exact()` (run only if needed)."""
    if len(got) != len(expected):
        raise VerificationError(f"{len(got)} {what}s from ORT, {len(expected)} from torch")
    reference: list | None = None
    for index, (actual, wanted) in enumerate(zip(got, expected)):
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
        scale = wanted.abs().max().item() if wanted.numel() else 0.0
        error = (actual - wanted).abs().max().item() if wanted.numel() else 0.0
        both_nan = torch.isnan(actual).equal(torch.isnan(wanted))
        relative, absolute = tolerance(wanted.dtype)
        if both_nan and error <= relative * scale + absolute:
            continue
        if both_nan and reference is None:
            reference = exact() or []
        if not both_nan or not _within_rounding(actual, wanted, reference, index):
            raise VerificationError(
                f"{what} {index}: ORT differs from torch by {error:.3g} (largest magnitude "
                f"{scale:.3g}), more than torch's own float rounding"
            )


ROUNDING_FACTOR = 10.0
"""How much farther from float64's result ORT's may be than torch's: both round in float32,
reducing in different orders and blockings."""


def _within_rounding(
    actual: torch.Tensor, wanted: torch.Tensor, reference: list, index: int
) -> bool:
    """ORT's distance to the float64 result at most ROUNDING_FACTOR times torch's."""
    if index >= len(reference) or not isinstance(reference[index], torch.Tensor):
        return False
    exact = reference[index].to(torch.float64)
    if exact.shape != wanted.shape:
        return False
    finite = torch.isfinite(exact)
    ort_error = (actual.double() - exact)[finite].abs().max().item() if finite.any() else 0.0
    torch_error = (wanted.double() - exact)[finite].abs().max().item() if finite.any() else 0.0
    return ort_error <= ROUNDING_FACTOR * torch_error


def _in_float64(gm: torch.fx.GraphModule, feeds: list[Feed], values: dict[str, Sequence]
                ) -> list | None:
    """The FX graph run again with every float input upcast to float64: the reference that
    rounding is measured against. None if the graph does not run so (an op that insists on
    float32): the fixed tolerance's verdict stands."""
    upcast = {
        kind: [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for v in sequence]
        for kind, sequence in values.items()
    }
    try:
        with torch.no_grad():
            return list(gm(*_feeds(feeds, upcast)))
    except Exception:  # noqa: BLE001 -- any failure leaves the mismatch a mismatch
        return None

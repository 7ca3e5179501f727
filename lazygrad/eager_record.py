"""What the first call of a signature, run by eager PyTorch, returned: its graphs must return it
too.

`verify.py` holds ORT's graphs to the FX graphs they were translated from; nothing there holds
those to the module. A trace can compute something else than the module's own run: a fast path
taken only when not traced (`nn.TransformerEncoder`'s nested tensors under no_grad), or an op
whose result is eager's kernel's own choice, which the trace makes otherwise (the order of
`topk(sorted=False)`, traced as the sorted one: Informer's attention then applied its dropout
mask to other rows than eager, and trained 0.1-0.3 off eager's gradients with no fallback). The
first call of a signature runs eagerly anyway; this keeps what it returned and the generator
state it drew from, so that the built forward, fed the same draws, is compared with it.

Each output is kept as an evenly strided sample of at most `SAMPLE` elements (a vocabulary
head's logits are not held whole through a build: the first step's peak is issue 10's). A call
that changed the module's state or its inputs in place (BatchNorm's running statistics, a power
iteration's vectors) is not kept: the build sees the state after the call, from which a forward
computes from other values than eager's did.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch

SAMPLE = 1 << 16


def sample(tensor: torch.Tensor) -> torch.Tensor:
    """An evenly strided sample of `tensor`'s elements (in row-major order), at most SAMPLE."""
    flat = tensor.detach().reshape(-1)
    return flat[:: max(1, -(-flat.numel() // SAMPLE))].clone()


@dataclasses.dataclass
class EagerRecord:
    samples: list[torch.Tensor]  # per module output (flat tensor leaves), `sample` of it
    generators: list[tuple[torch.device, torch.Tensor]]  # each generator's state before it

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """The generators where the call found them, and back where they are afterwards."""
        cuda = [device for device, _ in self.generators if device.type == "cuda"]
        with torch.random.fork_rng(devices=cuda):
            for device, state in self.generators:
                if device.type == "cuda":
                    torch.cuda.set_rng_state(state, device)
                else:
                    torch.set_rng_state(state)
            yield


class Watch:
    """Taken just before the eager call: the generators' states and the versions of the tensors
    it may change in place."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._versions = [_version(tensor) for tensor in self._tensors]
        cuda = {tensor.device for tensor in self._tensors if tensor.device.type == "cuda"}
        self._generators = [(torch.device("cpu"), torch.get_rng_state())] + [
            (device, torch.cuda.get_rng_state(device)) for device in sorted(cuda, key=str)]

    def changed(self) -> bool:
        """Whether a tensor it watches changed in place since (in the call, or after it: a
        parameter edited before the step's backward, when the build reads the state)."""
        return any(_version(tensor) != version
                   for tensor, version in zip(self._tensors, self._versions))

    def record(self, outputs: Sequence[torch.Tensor]) -> EagerRecord | None:
        """What the call returned, or None if it changed a tensor in place."""
        if self.changed():
            return None
        return EagerRecord([sample(output) for output in outputs], self._generators)

def _version(tensor: torch.Tensor) -> int | None:
    """Its version counter (None for an inference-mode tensor, which has none and cannot be
    changed in place outside inference mode)."""
    try:
        return tensor._version
    except RuntimeError:
        return None

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
head's logits are not held whole through a build: the first step's peak is issue 10's). The
build reads the module's state as it is then, after the call: a buffer the call changed in place
(BatchNorm's running statistics, a power iteration's vectors) is compared from a copy made
before it (the module's buffers are copied if they take at most `BUFFER_BYTES`); a call that
changed a parameter or an input in place, or a buffer not copied, is not compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lazygrad import generators
from lazygrad.code_globals import version_of

SAMPLE = 1 << 16
BUFFER_BYTES = 64 << 20


def sample(tensor: torch.Tensor) -> torch.Tensor:
    """An evenly strided sample of `tensor`'s elements (in row-major order), at most SAMPLE."""
    flat = tensor.detach().reshape(-1)
    return flat[:: max(1, -(-flat.numel() // SAMPLE))].clone()


@dataclasses.dataclass
class EagerRecord:
    samples: list[torch.Tensor]  # per module output (flat tensor leaves), `sample` of it
    states: list[tuple[torch.device, torch.Tensor]]  # each generator's state before the call
    state: dict[int, torch.Tensor]  # primal index -> its value before the call, where it changed

    def primals(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The call's primals as the call found them."""
        return [self.state.get(index, primal) for index, primal in enumerate(primals)]

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator on `device` where torch's was when the call began (a copy: torch's stays
        where it is, `generators.py`)."""
        return generators.copy_of(device, dict(self.states).get(device))


class Watch:
    """Taken just before the eager call: the generators' states, the versions of the tensors
    it may change in place, and copies of the buffers among them; `outputs` takes what the
    call returned, `record` says what the build compares with."""

    def __init__(self, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        self._tensors = [*state, *inputs]
        self._versions = [version_of(tensor) for tensor in self._tensors]
        buffers = {index: tensor for index, tensor in enumerate(state)
                   if not isinstance(tensor, torch.nn.Parameter)}
        small = sum(t.numel() * t.element_size() for t in buffers.values()) <= BUFFER_BYTES
        self._copies = {index: tensor.detach().clone() for index, tensor in buffers.items()} \
            if small else {}
        devices = {torch.device("cpu")} | {tensor.device for tensor in self._tensors}
        self._generators = [(device, generators.state(device))
                            for device in sorted(devices, key=str)]
        self._samples: list[torch.Tensor] = []

    def outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """Keep what the call returned (right after it: a caller may change it in place)."""
        self._samples = [sample(output) for output in outputs]

    def record(self) -> EagerRecord | None:
        """What the call returned and the state it started from, or None where a tensor that
        was not copied changed in place since the call began (in it, or after it: a parameter
        edited before the step's backward, whose build reads the state then)."""
        state = {}
        for index, (tensor, version) in enumerate(zip(self._tensors, self._versions)):
            if version_of(tensor) == version:
                continue
            if index not in self._copies:
                return None
            state[index] = self._copies[index]
        return EagerRecord(self._samples, self._generators, state)


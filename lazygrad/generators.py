"""torch's random generators: read, and copied, never set from another thread.

A build runs on the builder thread while the training thread goes on drawing (its eager steps'
Dropout, the script's own draws). A build that drew from torch's global generator inside
`fork_rng`, or a trace inside AOTAutograd's `preserve_rng_state`, set the generator back to
where it found it when done, and so took back every draw the training thread made meanwhile:
from the build's end on, the training's numbers were no longer eager's (a Dropout model's
stream left eager's from the step the build ended, for good). So a draw made off the training
thread, and a replay of a step's draws, comes from a copy of the generator (`copy_of`).
"""

from __future__ import annotations

import torch


def state(device: torch.device) -> torch.Tensor:
    """The state of torch's generator that draws on `device`."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_state(device: torch.device, value: torch.Tensor) -> None:
    """Set torch's generator on `device` (the training thread's own replays, as eager's)."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(value, device)
    else:
        torch.set_rng_state(value)


def copy_of(device: torch.device, value: torch.Tensor | None = None) -> torch.Generator:
    """A generator on `device` in the state `value` (None: the state torch's is in now): its
    draws are those torch's would make from that state, and torch's stays where it is."""
    generator = torch.Generator(device=device)
    generator.set_state(state(device) if value is None else value)
    return generator

"""The ATen ops whose result shares its input's storage in eager: the stages that decide what is
saved (copies.py before partitioning, tidy.py after it) treat them alike."""

from __future__ import annotations

import torch

aten = torch.ops.aten

VIEW_OPS = {
    aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.select.int, aten.slice.Tensor,
    aten.detach.default, aten.alias.default, aten.reshape.default,
}

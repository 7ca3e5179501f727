"""Ops whose output's length is read from data, made with the length the first call read.

`x[mask]` (a boolean mask; and `x[mask] = value`, whose backward selects so), `nonzero` (and
`argwhere`), one-argument `torch.where`, `masked_select`, `repeat_interleave` by a tensor of
repeats and `unique` return as many rows as the data says: a trace cannot size them, so a
model using one ran in parts (VideoMAE keeps its visible patches as `x[~bool_masked_pos]`;
X-MOD runs each language's rows through its adapter by a mask; Qwen2-VL's vision tower numbers
its images' patches by `repeat_interleave`). Each such length is first made as long as each
call's data says (`data_lengths.py`: the trace runs the op itself, whose size it does not know,
and the graph computes it). Where the code branches on the length or reshapes by it, that
line's length is the first call's (`checks.py` records it, by the line that made it, and keeps
the check that the data gives the same length): the selection becomes a `topk` of the
positions of the True elements (ascending: `nonzero`'s order) and a gather or a scatter of
those rows, `repeat_interleave` picks each output row's source by the running total of its
repeats (ONNX has no such op), and `unique` picks the first of each run of equal elements after
a stable sort. A call with another length there fails the check and runs in eager PyTorch; one
whose length changes every call ends in parts. A length of 0 fails the build's run of such a
graph (ORT made one row of the exported selection of none, and a scatter of none failed): that
module runs in parts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Form:
    """How one call's output length comes from its data."""

    length: Callable[[Any], int]  # of the op's result
    count: Callable[[], torch.Tensor]  # the tensor that holds that length (the check's)
    made: Callable[[int], Any]  # the op's result, of that length


def form(name: str, args: tuple, kwargs: dict) -> Form | None:
    """The form of a call of the op or method `name` whose output length is read from data, or
    None (another op, or a call of it whose length the shapes give)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    if name == "__getitem__" and len(args) == 2 and _is_mask(args[1]):
        return _boolean_index(*args)
    if name == "__setitem__" and len(args) == 3 and _is_mask(args[1]):
        return _boolean_assignment(*args)
    if name == "nonzero" and len(args) == 1 and set(kwargs) <= {"as_tuple"} \
            and args[0].dim() > 0:
        return _nonzero(args[0], bool(kwargs.get("as_tuple", False)))
    if name == "argwhere" and len(args) == 1 and not kwargs and args[0].dim() > 0:
        return _nonzero(args[0], False)
    if name == "where" and len(args) == 1 and not kwargs and args[0].dim() > 0:
        return _nonzero(args[0], True)
    if name == "masked_select" and len(args) == 2 and not kwargs and _is_mask(args[1]):
        return _masked_select(*args)
    if name == "repeat_interleave":
        return _repeat_interleave(args, kwargs)
    if name == "unique":
        return _unique(args, kwargs)
    return None


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() > 0


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The flat positions of the `count` non-zero elements of `mask`, ascending."""
    flat = mask.reshape(-1) != 0
    positions = torch.arange(flat.numel(), device=mask.device)
    return torch.where(flat, positions, positions + flat.numel()).topk(
        count, largest=False).indices


def _boolean_index(x: torch.Tensor, mask: torch.Tensor) -> Form | None:
    """`x[mask]`, a mask over the leading dimensions of `x`."""
    dims = mask.dim()
    if x.shape[:dims] != mask.shape:
        return None
    return Form(
        length=lambda result: result.shape[0],
        count=lambda: mask.sum(),
        made=lambda count: x.flatten(0, dims - 1)[_true_positions(mask, count)],
    )


def _boolean_assignment(x: torch.Tensor, mask: torch.Tensor, value: Any) -> Form | None:
    """`x[mask] = value`: its length is the selection's, which the backward reads (the
    gradient of `value` is the output gradient's `[mask]`)."""
    dims = mask.dim()
    if x.shape[:dims] != mask.shape:
        return None

    def made(count: int) -> None:
        rows = torch.unravel_index(_true_positions(mask, count), mask.shape)
        x.index_put_(rows, torch.as_tensor(value, dtype=x.dtype, device=x.device))

    # (`TensorBase.item`: `recording` wraps the tensor's own readers)
    return Form(length=lambda result: torch._C.TensorBase.item(mask.sum()),
                count=lambda: mask.sum(), made=made)


def _nonzero(x: torch.Tensor, as_tuple: bool) -> Form:
    def made(count: int) -> Any:
        rows = torch.unravel_index(_true_positions(x, count), x.shape)
        return rows if as_tuple else torch.stack(rows, dim=1)

    return Form(
        length=lambda result: (result[0] if as_tuple else result).shape[0],
        count=lambda: (x != 0).sum(),
        made=made,
    )


def _masked_select(x: torch.Tensor, mask: torch.Tensor) -> Form:
    def made(count: int) -> torch.Tensor:
        values, where = torch.broadcast_tensors(x, mask)
        return values.reshape(-1)[_true_positions(where, count)]

    return Form(
        length=lambda result: result.shape[0],
        count=lambda: torch.broadcast_tensors(x, mask)[1].sum(),
        made=made,
    )


def _repeat_interleave(args: tuple, kwargs: dict) -> Form | None:
    """`repeat_interleave(repeats)`, or `x.repeat_interleave(repeats, dim)` with a tensor of
    repeats and no `output_size`."""
    if kwargs.get("output_size") is not None or not args:
        return None
    if len(args) == 1 and not kwargs:
        x, repeats, dim = None, args[0], 0
    elif len(args) >= 2:
        x, repeats, dim = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("dim")
    else:
        return None
    if not isinstance(repeats, torch.Tensor) or len(args) > 3:
        return None
    along = None if x is None else x.numel() if dim is None else x.shape[dim]

    def made(count: int) -> torch.Tensor:
        """Which row each output row repeats, counted against the running total of the
        repeats (ONNX has no such op)."""
        each = repeats.reshape(-1)
        if along is not None and each.numel() == 1:
            each = each.expand(along)
        ends = each.cumsum(0)
        rows = (torch.arange(count, device=each.device)[:, None] >= ends).sum(1)
        if x is None:
            return rows.to(repeats.dtype)
        return (x.reshape(-1) if dim is None else x).index_select(0 if dim is None else dim, rows)

    return Form(
        length=lambda result: result.shape[0 if dim is None else dim],
        count=lambda: repeats.sum() if along is None or repeats.numel() != 1
        else repeats.reshape(()) * along,
        made=made,
    )


def _unique(args: tuple, kwargs: dict) -> Form | None:
    """`torch.unique(x, sorted=True, return_inverse, return_counts)` over all elements: the
    stable sort of the elements, the first of each run of equal ones picked (the inverse: each
    element's run, scattered back by the sort's order; the counts: the runs' lengths)."""
    names = ("sorted", "return_inverse", "return_counts", "dim")
    given = dict(zip(names, args[1:]), **kwargs)
    if len(args) > 5 or set(given) - set(names) or not given.get("sorted", True) \
            or given.get("dim") is not None or args[0].numel() == 0:
        return None
    x, inverse, counts = args[0], bool(given.get("return_inverse")), \
        bool(given.get("return_counts"))

    @functools.cache
    def runs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sorted elements, the sort's order, and where each run of equal ones starts."""
        values, order = x.reshape(-1).sort(stable=True)
        first = torch.cat([torch.ones(1, dtype=torch.bool, device=x.device),
                           values[1:] != values[:-1]])
        return values, order, first

    def made(count: int) -> Any:
        values, order, first = runs()
        starts = _true_positions(first, count)
        results = [values[starts]]
        if inverse:
            run = first.cumsum(0) - 1
            results.append(torch.zeros_like(run).scatter(0, order, run).reshape(x.shape))
        if counts:
            end = torch.full((1,), x.numel(), dtype=starts.dtype, device=x.device)
            results.append(torch.diff(starts, append=end))
        return tuple(results) if len(results) > 1 else results[0]

    return Form(
        length=lambda result: (result[0] if isinstance(result, tuple) else result).shape[0],
        count=lambda: runs()[2].sum(),
        made=made,
    )

"""The build's check of a selection's indices: a near tie may be ordered either way, a wrong
index is caught."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lazygrad.verify import VerificationError, _ForwardCheck, _Suspects

aten = torch.ops.aten


def _selections(x: torch.Tensor, image: torch.Tensor):
    pooled, pool_indices = aten.max_pool2d_with_indices(image, [2, 2], [2, 2])
    largest, largest_indices = x.max(dim=1)
    top, top_indices = x.topk(2, dim=1)
    return pooled, pool_indices, largest, largest_indices, top, top_indices, x.argmax()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Each selection's first pick (of the first row, window) has a near tie: a value one
    rounding below it, where another kernel's rounding could have put it above; the second
    has an exact tie."""
    below = 1.0 - 2 ** -23
    x = torch.tensor([[1.0, 0.0, below, -1.0], [0.9, 0.5, 0.9, 0.0]])
    image = torch.zeros(1, 1, 2, 4)
    image[0, 0, 0, 0], image[0, 0, 1, 1] = 1.0, below
    image[0, 0, 0, 3] = image[0, 0, 1, 2] = 2.0
    return x, image


@pytest.mark.parametrize("position, nearly_tied, wrongs", [
    # max pooling (flat positions in the image's plane): a smaller value, the exact tie's other
    (1, [[[[5, 3]]]], [[[[[4, 3]]]], [[[[0, 6]]]]]),
    (3, [2, 0], [[1, 0], [0, 2]]),  # max(dim)
    (5, [[2, 0], [0, 2]], [[[3, 0], [0, 2]], [[0, 2], [2, 0]]]),  # topk
    (6, 2, [1]),  # argmax of every element
])
def test_indices_of_a_near_tie_pass_and_a_wrong_index_fails(position, nearly_tied, wrongs):
    """ORT's convolution rounds differently from torch's, so a pooling window's two largest
    inputs, a rounding apart, can come out in the other order: a VGG ran in parts for it. Both
    picks are right within rounding, as their values are. An index that picks a value that is
    not the largest, or the other of an exact tie (ORT and torch both take the first), is a
    translation bug and still fails."""
    graph = make_fx(_selections)(*_inputs())
    wanted = list(_selections(*_inputs()))
    assert wanted[position].tolist() != nearly_tied

    for indices, passes in ((nearly_tied, True), *((wrong, False) for wrong in wrongs)):
        got = [t.clone() for t in wanted]
        got[position] = torch.tensor(indices)
        suspects = _Suspects()
        check = _ForwardCheck(graph, got, kept=set(), suspects=suspects)
        if passes:
            check.run(*_inputs())
            suspects.judge(lambda: pytest.fail("no float result differs"))
        else:
            with pytest.raises(VerificationError, match=f"forward result {position}: ORT and "
                                                        "torch differ"):
                check.run(*_inputs())

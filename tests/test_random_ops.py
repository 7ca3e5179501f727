"""Random ops inside a module: drawn from torch's generator, as eager draws them.

Under the same `torch.manual_seed` a lazy step draws what eager draws (outputs, gradients and the
generator's state after the step are eager's), two runs are identical, and a recompute after a
missed mask (policy "predict") reuses the forward's draws instead of drawing again.
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, assert_grads_equal, ran_through_ort

import lazygrad


def _bernoulli(h):
    return h * torch.bernoulli(torch.sigmoid(h)) + h * torch.empty_like(h).bernoulli_(0.3)


def _rand(h):
    return h * torch.rand(h.shape[0], h.shape[1]) + torch.rand_like(h) - torch.randn_like(h) * h \
        + torch.randn(h.shape[0], 1)


def _multinomial(h):
    probs = h.softmax(-1)
    return torch.cat([h.gather(1, torch.multinomial(probs, 3)),
                      h.gather(1, torch.multinomial(probs, 4, replacement=True))], 1)


def _more_distributions(h):
    return (h * torch.empty_like(h).uniform_(-1, 2) + torch.normal(h, 0.5)
            + h * torch.empty_like(h).exponential_(2.0))[:, torch.randperm(h.shape[1])]


def _of_transposed(h):
    """Draws eager makes in a transposed tensor's memory order (`empty_like` keeps its layout):
    Dropout, `rand_like` and `bernoulli` of a transposed tensor."""
    t = h.t()
    return (torch.nn.functional.dropout(t, 0.3) + torch.rand_like(t)
            + torch.bernoulli(torch.sigmoid(t))).t()


def _random_integers(h):
    """`random_(low, high)` and `random_(high)` (the first's overload, named `from`, made the
    trace's Python code invalid: the model ran in parts), and `randint_like`."""
    return h * torch.empty_like(h).random_(1, 4) + torch.empty_like(h).random_(3) \
        + torch.randint_like(h, 5) * torch.randint_like(h, -2, 2)  # RT-DETR's (refused before)


RANDOM = {
    "bernoulli": _bernoulli,
    "random_integers": _random_integers,
    "of_transposed": _of_transposed,
    "rand_randn": _rand,
    "multinomial": _multinomial,
    "uniform_normal_exponential_randperm": _more_distributions,
}


class TwoHeads(torch.nn.Module):
    """The random op feeds both heads: a step that trains the second head after steps that did
    not needs the random values again (under "predict", a recompute of the forward)."""

    def __init__(self, op) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.first = torch.nn.Linear(8, 3)
        self.second = torch.nn.Linear(8, 2)
        self.op = op

    def forward(self, x):
        h = torch.tanh(self.body(x))
        r = self.op(h)
        r = r[:, :8] if r.shape[1] >= 8 else torch.cat([r, h], 1)[:, :8]
        return self.first(r), self.second(r * h)


MASKS = [(True, False), (True, False), (True, True), (False, True)]


def _step(model, x, seed: int, mask):
    """Outputs, gradients and the generator's next number after one seeded step."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    outputs = model(x)
    sum((o * (i + 1)).sum() for i, (o, bit) in enumerate(zip(outputs, mask)) if bit).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return outputs, grads, torch.rand(1)


def _masked_step_like_eager(lazy, eager, x, step: int, mask, what: str):
    """One seeded step of each model (`_step`): outputs, gradients and the generator's state
    after it are eager's. Returns the lazy model's outputs and gradients."""
    outputs, grads, after = _step(lazy, x, 100 + step, mask)
    expected, _, eager_after = _step(eager, x, 100 + step, mask)
    for got, want in zip(outputs, expected):
        assert_close(got.detach(), want.detach(), f"{what}: output")
    assert_grads_equal(lazy, eager, what)
    assert torch.equal(after, eager_after), f"{what}: the generator moved unlike eager's"
    return outputs, grads


@pytest.mark.parametrize("name", RANDOM)
def test_random_op_draws_what_eager_draws_and_a_recompute_reuses_the_draws(name):
    torch.manual_seed(0)
    eager = TwoHeads(RANDOM[name])
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    for step, mask in enumerate(MASKS):
        what = f"{name} step {step} mask {mask}"
        outputs, grads = _masked_step_like_eager(lazy, eager, x, step, mask, what)
        if step > 0:
            assert ran_through_ort(outputs), what
            again, grads_again, _ = _step(lazy, x, 100 + step, mask)  # same seed, same step
            for first, second in zip(outputs, again):
                assert torch.equal(first, second), f"{what}: a rerun under the seed differs"
            for n, g in grads.items():
                assert (g is None and grads_again[n] is None) or torch.equal(g, grads_again[n]), n
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0
    assert stats.recomputes == 2  # steps 2 and 3 missed the plan of the step before


class OwnGenerator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x):
        h = self.linear(x)
        return h * torch.rand(4, generator=self.generator)


@pytest.mark.falls_back
def test_a_draw_from_a_generator_of_the_modules_own_falls_back_and_is_never_baked_in():
    model = lazygrad.lazy(OwnGenerator())
    x = torch.randn(3, 4)
    with pytest.warns(lazygrad.FallbackWarning, match="generator of its own"):
        outputs = [model(x) for _ in range(3)]
        for out in outputs:
            out.sum().backward()
    assert not torch.equal(outputs[1], outputs[2])  # each step draws anew, as eager does
    assert lazygrad.stats(model).breaks == 1  # its own code eagerly, its Linear on its own


from random import random as random_by_name  # noqa: E402  (as a script imports it)

SCRIPTS_GENERATOR = np.random.default_rng(0)  # a generator of the training script's


class TeacherForcing(torch.nn.Module):
    """A seq2seq decoder that feeds the target token or its own guess, by a draw from Python's
    or NumPy's random numbers (as the well-known PyTorch seq2seq tutorials decide teacher
    forcing): from the global generators, through a function imported by name, or from a
    generator of the module's own or of the script's."""

    def __init__(self, generator: str) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.cell = torch.nn.GRUCell(8, 16)
        self.out = torch.nn.Linear(16, 20)
        self.generator = generator
        self.python_generator = random.Random(1)
        self.numpy_generator = np.random.default_rng(1)

    def draw(self) -> float:
        if self.generator == "random":
            return random.random()
        if self.generator == "numpy":
            return np.random.uniform()
        if self.generator == "imported by name":
            return random_by_name()
        if self.generator == "the module's random.Random":
            return self.python_generator.random()
        if self.generator == "the module's numpy Generator":
            return self.numpy_generator.uniform()
        return SCRIPTS_GENERATOR.uniform()

    def forward(self, target):
        hidden, token, logits = torch.zeros(target.shape[0], 16), target[:, 0], []
        for t in range(1, target.shape[1]):
            hidden = self.cell(self.embed(token), hidden)
            logits.append(self.out(hidden))
            token = target[:, t] if self.draw() < 0.5 else logits[-1].argmax(-1)
        return torch.stack(logits, 1)


@pytest.mark.parametrize("generator", [
    "random", "numpy", "imported by name", "the module's random.Random",
    "the module's numpy Generator", "the script's numpy Generator"])
def test_a_draw_from_pythons_or_numpys_random_in_the_forward_is_never_baked_in(generator):
    """Traced, the branch of the trace's one draw served every step (0.42 off, no fallback; a
    function imported by name and the generators of the module's own and of the script's were
    not seen until later): now the forward runs in eager PyTorch (its GRU cell, embedding and
    head as lazy parts)."""
    torch.manual_seed(0)
    eager = TeacherForcing(generator)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with pytest.warns(lazygrad.GraphBreakWarning, match="draws from a random generator"):
        for step in range(4):
            target = torch.randint(0, 20, (3, 6))
            states = random.getstate(), np.random.get_state()
            scripts_state = SCRIPTS_GENERATOR.bit_generator.state
            got = lazy(target)
            random.setstate(states[0])
            np.random.set_state(states[1])
            SCRIPTS_GENERATOR.bit_generator.state = scripts_state
            want = eager(target)
            assert_close(got.detach(), want.detach(), f"logits, step {step}")
            for model, out in ((lazy, got), (eager, want)):
                model.zero_grad(set_to_none=True)
                out.square().mean().backward()
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert sum(part.hits for part in stats.parts.values()) > 0


@pytest.mark.parametrize("generator", ["random", "imported by name"])
def test_a_refused_trace_leaves_the_scripts_random_numbers_as_they_were(generator):
    """The trace that finds a draw draws from a copy of the generator: the script's seeded
    stream (its data shuffling) is eager's after a lazy step, where it was one draw ahead."""
    eager = TeacherForcing(generator)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    target = torch.randint(0, 20, (3, 6))
    after = []
    for model in (lazy, eager):
        random.seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", lazygrad.GraphBreakWarning)
            model(target).square().mean().backward()  # lazy: traced at this backward
        after.append(random.random())
    assert after[0] == after[1]
    assert lazygrad.stats(lazy).breaks == 1


class Reseeds(torch.nn.Module):
    """A fixed augmentation: the forward reseeds torch's generator, then draws (or not: the
    seed is for what the script draws next)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(p)
        self.second = torch.nn.Linear(8, 2)

    def forward(self, x):
        torch.manual_seed(123)
        return self.second(self.drop(self.first(x)))


@pytest.mark.parametrize("p", [0.5, 0.0])
def test_a_forward_that_reseeds_torchs_generator_is_never_baked_in(p):
    """No ORT step reseeds: every step after the first drew another Dropout mask than eager
    (0.87 off, silently), and, with no draw in the module, left the generator elsewhere than
    eager for the script's next draws. The trace that calls `torch.manual_seed` is refused (the
    call recorded, not made): the module's own code runs eagerly, its Linears through ORT."""
    torch.manual_seed(0)
    eager = Reseeds(p)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with pytest.warns(lazygrad.GraphBreakWarning, match=r"reseeds one \(torch.manual_seed\)"):
        for step in range(4):
            x = torch.randn(4, 8)
            after = []
            for model in (lazy, eager):
                torch.manual_seed(step)
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
                after.append(torch.rand(3))
            assert torch.equal(after[0], after[1]), f"step {step}: the generator's state"
            assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0
    assert stats.parts["first"].hits > 0


class ReplaysItsDropout(torch.autograd.Function):
    """A reversible layer's way: the forward saves the generator's state and drops out without
    saving its activations; the backward sets the state back and recomputes them, mask and all."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.state = torch.get_rng_state()
        ctx.save_for_backward(x, weight)
        with torch.no_grad():
            return F.dropout(x @ weight, 0.5, True)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.state)
            with torch.enable_grad():
                x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
                recomputed = F.dropout(x @ weight, 0.5, True)
                return torch.autograd.grad(recomputed, (x, weight), grad)


class Reversible(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(0.3 * torch.randn(8, 8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(ReplaysItsDropout.apply(x, self.weight)))


def test_a_backward_that_replays_its_forwards_draws_from_a_saved_state_is_refused():
    """Traced, the backward's recomputed Dropout was a draw of its own, made anew at each ORT
    step: the weight's gradient came out 1.2-1.5 off eager's, silently. Setting torch's
    generator in the module's code is refused (`python_random.py`); the module's own code runs
    eagerly, its head through ORT."""
    torch.manual_seed(0)
    eager = Reversible()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    with pytest.warns(lazygrad.GraphBreakWarning, match=r"torch.set_rng_state"):
        for step in range(3):
            x = torch.randn(4, 8)
            _seeded_step_like_eager(lazy, eager, step, x, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0, stats.reasons
    assert stats.parts["head"].hits > 0


def _seeded_step_like_eager(lazy, eager, seed: int, x: torch.Tensor, what: str,
                            cotangent: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """One step of both models on `x` under the same seed, the backward of the output times
    `cotangent` (else of its squares): the output and the gradients are eager's. Returns the
    lazy model's output."""
    outputs = []
    for model in (lazy, eager):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        out = model(x, **kwargs)
        (out * cotangent if cotangent is not None else out.square()).sum().backward()
        outputs.append(out)
    assert_close(outputs[0].detach(), outputs[1].detach(), f"{what}: output")
    assert_grads_equal(lazy, eager, what)
    return outputs[0]


def test_a_transformer_layers_dropout_draws_what_eager_draws():
    """MultiheadAttention's batch-first output is a transposed view, so eager's Dropout draws
    its mask in the transposed order; drawn contiguous, every ORT step of an
    nn.TransformerEncoderLayer in training dropped other units than eager (0.56 off in its
    output), with no fallback."""
    torch.manual_seed(0)
    eager = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    for step in range(3):
        x, cotangent = torch.randn(3, 6, 16), torch.randn(3, 6, 16)
        # not a sum of squares: constant after the layer's closing norm
        out = _seeded_step_like_eager(lazy, eager, 10 + step, x, f"step {step}", cotangent,
                                      src_key_padding_mask=padding)
    assert ran_through_ort([out]) and lazygrad.stats(lazy).fallbacks == 0


class StackedRecurrent(torch.nn.Module):
    """Stacked recurrent layers with dropout between them, as language models and seq2seq
    encoders write them."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        make = {"lstm": lambda: torch.nn.LSTM(5, 6, num_layers=3, dropout=0.5,
                                              bidirectional=True),
                "gru": lambda: torch.nn.GRU(5, 6, num_layers=2, dropout=0.3, batch_first=True),
                "rnn": lambda: torch.nn.RNN(5, 6, num_layers=2, dropout=0.4, nonlinearity="relu",
                                            batch_first=True)}[kind]
        self.rnn = make()

    def forward(self, x):
        out, _ = self.rnn(x)
        return out


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_dropout_between_stacked_recurrent_layers_draws_what_eager_draws(kind):
    """torch's RNN decomposition never applies the dropout between layers (its test of the
    layer index never holds): every ORT step of a 2-layer GRU with dropout computed the layers
    without it (0.45 off in its output) and drew nothing, with no fallback
    (`private.recurrent_layers_as_eager`). The generator is left as eager leaves it."""
    torch.manual_seed(0)
    eager = StackedRecurrent(kind)
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(3):
        out = _seeded_step_like_eager(lazy, eager, 10 + step, torch.randn(4, 7, 5), f"step {step}")
        after = []
        for model in (lazy, eager):
            torch.manual_seed(10 + step)
            with torch.no_grad():
                model(torch.ones(4, 7, 5))
            after.append(torch.rand(3))
        assert torch.equal(*after), f"step {step}: the generator after the call"
    assert ran_through_ort([out]) and lazygrad.stats(lazy).fallbacks == 0


class UnreadDropout(torch.nn.Module):
    """Drops out a tensor it never reads (as Hugging Face's Canine does), then one it does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        h = self.linear(x)
        self.dropout(h)
        return self.dropout(torch.tanh(h))


def test_a_dropout_whose_result_nothing_reads_draws_as_eager_and_the_model_runs_through_ort():
    """AOTAutograd's partitioner took the unread dropout's result for a tensor and failed
    ("Expected native_dropout to be a tensor"): the model ran in parts. Its draw is made as
    eager makes it, so the dropout after it drops what eager drops."""
    torch.manual_seed(0)
    eager = UnreadDropout()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        out = _seeded_step_like_eager(lazy, eager, 10 + step, torch.randn(4, 8), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert ran_through_ort([out]) and (stats.breaks, stats.fallbacks) == (0, 0)


class ConvDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.dropout(self.conv(x), 0.3)


def test_dropout_of_a_channels_last_activation_draws_in_its_layout():
    """A channels-last input makes the convolution's output channels last, and eager's
    Dropout mask is drawn in that order: the input's layout is part of the signature, so
    each layout has its graph, with its draws."""
    torch.manual_seed(0)
    eager = ConvDropout()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step, layout in enumerate([torch.contiguous_format, torch.channels_last] * 2):
        x = torch.randn(2, 3, 5, 6).contiguous(memory_format=layout)
        _seeded_step_like_eager(lazy, eager, 10 + step, x, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.exports, stats.hits, stats.fallbacks) == (2, 2, 0)


def test_dropout_after_the_model_is_converted_to_channels_last_draws_in_its_new_layout():
    """Channels-last weights make the convolution's output channels last: a model converted
    after its first build is another signature (the parameters' layouts are part of it), with
    its own draws."""
    torch.manual_seed(0)
    eager = ConvDropout()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(4):
        if step == 2:
            for model in (lazy, eager):
                model.to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 5, 6)
        _seeded_step_like_eager(lazy, eager, 10 + step, x, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.exports, stats.hits, stats.fallbacks) == (2, 2, 0)


class DropoutBetween(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(64, 256)
        self.second = torch.nn.Linear(256, 8)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.second(self.drop(torch.relu(self.first(x))))


def test_the_stash_keeps_a_dropouts_mask_not_its_draw_and_a_missed_plan_draws_it_again():
    """The forward kept every random draw for the backward, though a dropout's backward reads
    its boolean mask (kept too), never the float32 draw the mask came from: four bytes an
    element beside the mask's one (a BERT's attention dropout, of its largest activations).
    The draws are now kept only for a backward that reads them; a step whose backward misses
    the plan (another mask) draws them again from the step's generator state, and its
    gradients and the generator after it are eager's."""
    torch.manual_seed(0)
    eager = TwoHeads(lambda h: torch.nn.functional.dropout(h, 0.5))
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    for step, mask in enumerate(MASKS):
        _masked_step_like_eager(lazy, eager, x, step, mask, f"step {step} mask {mask}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.recomputes == 2 and stats.builds == 3

    torch.manual_seed(0)
    model = lazygrad.lazy(DropoutBetween())
    x = torch.randn(128, 64)
    for _ in range(3):
        saved = []

        def pack(tensor, saved=saved):
            if not isinstance(tensor, torch.nn.Parameter) and tensor.numel() >= 128 * 256:
                saved.append(tensor.dtype)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(x)
        out.sum().backward()
    assert ran_through_ort([out])
    # the dropout's mask, the ReLU's output (its backward reads it), the second layer's input
    assert sorted(map(str, saved)) == ["torch.bool", "torch.float32", "torch.float32"]


def test_rrelu_out_of_training_runs_through_ort_as_its_leaky_relu():
    """RReLU in eval mode draws nothing (a leaky ReLU of slope (lower + upper) / 2), but its op
    is a random one, and the trace refused it as one: a model with RReLU ran in parts in eval
    mode. In training its draws depend on the values, and it still runs in parts."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RReLU(0.1, 0.3),
                                torch.nn.Linear(8, 4)).eval()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        out = _seeded_step_like_eager(lazy, eager, 10 + step, torch.randn(5, 8), f"step {step}")
    stats = lazygrad.stats(lazy)
    assert ran_through_ort([out]) and (stats.breaks, stats.fallbacks) == (0, 0)


class PicksRows(torch.nn.Module):
    """Informer's ProbSparse attention in small: the rows a `topk` picks, then Dropout over
    those rows (a mask by position). Unsorted, their order is the one eager's kernel returns;
    the BatchNorm in front changes its running statistics at every call in training."""

    def __init__(self, unsorted: bool) -> None:
        super().__init__()
        self.unsorted = unsorted
        self.norm = torch.nn.BatchNorm1d(8)
        self.score = torch.nn.Linear(8, 1)
        self.proj = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        picked = self.score(x).squeeze(-1).topk(12, sorted=not self.unsorted).indices
        rows = torch.gather(x, 1, picked[..., None].expand(-1, -1, x.shape[-1]))
        return self.drop(self.proj(rows)).sum(1)


@pytest.mark.falls_back  # in parts, when unsorted
@pytest.mark.parametrize("unsorted", [True, False])
def test_a_graph_that_computes_otherwise_than_the_module_is_refused_by_its_first_call(unsorted):
    """Traced as the sorted top-k, `topk(sorted=False)` made the graph apply the Dropout mask to
    other rows than eager (its order is eager's kernel's own): the output half its size off at
    ORT steps, silently, where the check of ORT against the trace saw nothing. The built
    forward was then held to what the signature's first (eager) call returned; a part whose
    forward passed that comparison still trained with other gradients (Hugging Face's
    Informer), so the check now runs the FX graphs again with the picks rotated, and refuses
    graphs whose outputs or gradients change (`open_order.py`); sorted, the same model runs
    whole through ORT."""
    torch.manual_seed(0)
    eager = PicksRows(unsorted)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(4, 24, 8)
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        got = lazy(x)
        torch.manual_seed(step)
        want = eager(x)
        assert_close(got.detach(), want.detach(), f"step {step}: output")
        got.square().sum().backward()
        want.square().sum().backward()
        assert_grads_equal(lazy, eager, f"step {step}")
        assert_close(lazy.norm.running_mean, eager.norm.running_mean, f"step {step}")
    stats = lazygrad.stats(lazy)
    if unsorted:
        assert stats.breaks == 1, stats.reasons
        assert "depends on the order of a `topk(sorted=False)`'s picks" in stats.reasons[0]
        assert stats.parts["proj"].hits >= 1
    else:
        assert stats.hits == 2 and stats.breaks == 0 and stats.fallbacks == 0, stats.reasons

"""What the capture must get right on ordinary module code, each step against eager PyTorch.

The first training step of a new input signature runs in eager PyTorch while its graph is built
at the first backward; from the second step on it runs through ONNX Runtime. So every test runs
at least three steps, compares each one, and its statistics are about steps 2+.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, assert_grads_equal

import lazygrad


def _assert_params_equal(lazy: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert_close(p.detach(), q.detach(), f"{what}: {name}")


def _step(lazy, eager, args, loss_of, what, optimizers=(), after_backward=None):
    """One training step of both models on the same input; outputs and gradients compared."""
    for m in (lazy, eager):
        m.zero_grad(set_to_none=True)
    out, expected = lazy(*args), eager(*args)
    outs = out if isinstance(out, tuple) else (out,)
    expecteds = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(expecteds), what
    for index, (got, want) in enumerate(zip(outs, expecteds)):
        assert_close(got.detach(), want.detach(), f"{what}: output {index}")
    loss_of(out).backward()
    loss_of(expected).backward()
    if after_backward is not None:
        after_backward()
    assert_grads_equal(lazy, eager, what)
    for opt in optimizers:
        opt.step()
    return out, expected


# ---------------------------------------------------------------------------------------------
# 1. Python values derived from sizes


class SizeDerivedAttention(torch.nn.Module):
    """Size arithmetic as Python numbers, a branch on a size, and a `torch._assert` on a size."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.width, self.heads = width, heads
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        torch._assert(x.size(-1) == self.width, "x has the wrong width")
        batch, seq, _ = x.shape
        scale = math.sqrt(x.size(-1) // self.heads)
        q, k, v = (
            t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)
        )
        if x.size(1) != 1:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = (q @ k.transpose(-2, -1) / scale).masked_fill(~causal, float("-inf"))
            y = scores.softmax(-1) @ v
        else:  # one token: a gate instead of attention
            y = v * torch.sigmoid((q * k).sum(-1, keepdim=True) / scale)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.width))


def test_size_derived_python_values_branches_and_asserts_run_through_ort_with_two_exports():
    """The first shape's exact sizes, then sizes as symbols: one graph serves every later batch
    size and sequence length > 1."""
    torch.manual_seed(0)
    eager = SizeDerivedAttention()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    loss_of = lambda o: o.square().mean()  # noqa: E731
    for batch, seq in [(2, 5), (3, 7), (4, 3), (2, 9)]:
        x = torch.randn(batch, seq, 8)
        _step(lazy, eager, (x,), loss_of, f"shape {(batch, seq)}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0
    assert stats.exports == 2, "exact sizes, then one graph for every size > 1"
    assert stats.builds == 2 and stats.hits == 2, "one grad mask"
    # Sequence length 1 takes the other branch: a new capture is fine, a wrong result is not.
    for batch in (2, 3, 2):
        x = torch.randn(batch, 1, 8)
        _step(lazy, eager, (x,), loss_of, f"shape {(batch, 1)}")
    assert lazygrad.stats(lazy).fallbacks == 0


# ---------------------------------------------------------------------------------------------
# 2. Embedding padding_idx


class PaddedEmbedding(torch.nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.proj = torch.nn.Linear(dim, 3)

    def forward(self, ids):
        return self.proj(torch.tanh(self.embed(ids)))


def test_embedding_padding_row_gets_exactly_zero_gradient():
    torch.manual_seed(0)
    eager = PaddedEmbedding()
    with torch.no_grad():  # a nonzero padding row: training it would show
        eager.embed.weight[0] = torch.randn(6)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    padding_row = eager.embed.weight[0].detach().clone()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (lazy, eager)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 12, (3, 7), generator=generator)
        ids[:, -2:] = 0  # padding at the end of every row, and wherever randint put a 0
        _step(lazy, eager, (ids,), lambda o: o.square().sum(), f"step {step}", opts)
        assert torch.equal(lazy.embed.weight.grad[0], torch.zeros(6)), f"step {step}"
        assert torch.equal(lazy.embed.weight[0].detach(), padding_row), f"step {step}"
    assert lazygrad.stats(lazy).fallbacks == 0


class MaxNormLM(torch.nn.Module):
    """An embedding whose rows are renormalised in place at every lookup, tied to the head."""

    def __init__(self, vocab: int = 12, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, max_norm=1.0)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def test_an_embedding_with_max_norm_renorms_its_rows_and_trains_like_eager():
    """`Embedding(max_norm=...)` changes its weight in place, under no_grad, at every lookup.
    AOTAutograd gives the changed weight a cotangent of its own, which made the capture fail
    ("the backward takes 2 cotangents where 1 outputs get one"): the model ran eagerly."""
    torch.manual_seed(0)
    eager = MaxNormLM()
    with torch.no_grad():
        eager.embed.weight.mul_(3.0)  # rows beyond the max norm, so the lookups renorm them
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (lazy, eager)]
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, 12, (3, 5), generator=generator)
        weight = lazy.embed.weight
        _step(lazy, eager, (ids,), lambda o: o.square().sum(), f"step {step}", optimizers)
        _assert_params_equal(lazy, eager, f"after step {step}")
        assert lazy.embed.weight is weight and lazy.head.weight is weight, f"step {step}"
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 3, stats


class ClampsItsWeight(torch.nn.Module):
    """Gemma-3n's AltUp in small: in training, a weight clamped in place through `.data`."""

    def __init__(self) -> None:
        super().__init__()
        self.coefs = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        if self.training:
            self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.head(torch.tanh(self.coefs(x)))


def test_a_weight_clamped_through_its_data_in_the_forward_trains_like_eager():
    """Gemma-3n ran in parts ("the backward takes 3 cotangents where 1 outputs get one"): its
    two layers' prediction coefficients are clamped in place each training call."""
    torch.manual_seed(0)
    eager = ClampsItsWeight()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (lazy, eager)]
    for step in range(4):
        _step(lazy, eager, (torch.randn(4, 8),), lambda o: o.square().sum(), f"step {step}",
              optimizers)
        _assert_params_equal(lazy, eager, f"after step {step}")
    assert eager.coefs.weight.abs().max() < 0.2  # clamped at every step, then stepped
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 3, stats.reasons


class DoublesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2.0)  # recorded by autograd: the caller's later uses of x differentiate it
        return self.linear(x)


@pytest.mark.falls_back  # in parts
def test_an_input_changed_in_place_under_autograd_is_refused_not_trained_wrong():
    """Only a parameter's change in place (under no_grad, as a leaf's must be) drops its
    cotangent: an input's recorded change sends the caller's later gradient through it. Taken
    for a parameter's, x's gradient was 1.0 off, silently."""
    torch.manual_seed(0)
    eager = DoublesItsInput()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    for step in range(3):
        base = torch.randn(3, 4)
        grads = []
        for model in (lazy, eager):
            source = base.clone().requires_grad_()
            x = source * 1.0
            out = model(x)
            (out.square().sum() + x.sum()).backward()
            grads.append((out.detach(), x.detach(), source.grad))
        for index, (got, want) in enumerate(zip(*grads)):
            assert_close(got, want, f"step {step}: result {index}")
        assert_grads_equal(lazy, eager, f"step {step}")
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and "changed in place" in stats.reasons[0], stats
    assert stats.parts["linear"].hits >= 1


# ---------------------------------------------------------------------------------------------
# 3. Shared submodules and tied weights


class SharedBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.linear = torch.nn.Linear(dim, dim)
        self.register_buffer("shift", torch.full((dim,), 0.1))

    def forward(self, h):
        return h + torch.tanh(self.linear(self.norm(h)) + self.shift)


class TiedLM(torch.nn.Module):
    """One block under two names (called twice), and an output head tied to the embedding."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = SharedBlock(dim)
        self.a = block
        self.b = block
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def body(self, h):
        return self.b(self.a(h))

    def forward(self, ids, targets):
        logits = self.head(self.body(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _lm_batch(generator: torch.Generator, vocab: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 6), generator=generator)
    return ids, ids.roll(-1, dims=1)


def _assert_sharing_holds(model: TiedLM) -> None:
    assert model.a is model.b
    assert model.head.weight is model.embed.weight


def test_shared_submodule_and_tied_weights_train_like_eager_and_stay_shared():
    torch.manual_seed(0)
    eager = TiedLM()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    _assert_sharing_holds(lazy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (lazy, eager)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = _lm_batch(generator)
        _step(lazy, eager, batch, lambda o: o[0], f"step {step}", opts)
        _assert_params_equal(lazy, eager, f"after step {step}")
    assert lazygrad.stats(lazy).fallbacks == 0
    _assert_sharing_holds(lazy)
    assert len(list(lazy.parameters())) == len(list(eager.parameters()))


# ---------------------------------------------------------------------------------------------
# 4. A failed capture leaves the module as it was


class DataDependentTiedLM(TiedLM):
    """TiedLM whose depth depends on the values of the ids: no graph can hold that."""

    def body(self, h, repeats=1):
        for _ in range(repeats):
            h = self.a(h)
        return self.b(h)

    def forward(self, ids, targets):
        n = int((ids % 3 == 0).sum().numpy())  # read through NumPy: no trace can see it
        logits = self.head(self.body(self.embed(ids), repeats=1 + n % 2))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "parameters": {
            n: (p, p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)
        },
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers(remove_duplicate=False)},
        "modules": dict(model.named_modules(remove_duplicate=False)),
        "state_dict_keys": list(model.state_dict().keys()),
    }


def _assert_unchanged(model: torch.nn.Module, before: dict) -> None:
    for kind, named in [
        ("parameters", dict(model.named_parameters(remove_duplicate=False))),
        ("buffers", dict(model.named_buffers(remove_duplicate=False))),
    ]:
        assert list(named) == list(before[kind]), kind
        for name, (obj, value) in before[kind].items():
            assert named[name] is obj, f"{kind} {name} was replaced"
            assert torch.equal(named[name].detach(), value), f"{kind} {name} changed value"
    modules = dict(model.named_modules(remove_duplicate=False))
    assert list(modules) == list(before["modules"])
    for name, module in before["modules"].items():
        assert modules[name] is module, f"submodule {name!r} was replaced"
    assert list(model.state_dict().keys()) == before["state_dict_keys"]


def _ids_with_multiples_of_three(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids with exactly `count` multiples of 3, so the depth differs from step to step."""
    generator = torch.Generator().manual_seed(count)
    allowed = torch.tensor([v for v in range(1, 20) if v % 3])
    ids = allowed[torch.randint(0, len(allowed), (2, 6), generator=generator)]
    ids.view(-1)[:count] = 3
    return ids, ids.roll(-1, dims=1)


@pytest.mark.falls_back
def test_failed_capture_falls_back_once_and_leaves_the_module_unchanged():
    torch.manual_seed(0)
    eager = DataDependentTiedLM()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    before = _snapshot(lazy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (lazy, eager)]
    with pytest.warns(lazygrad.FallbackWarning) as record:
        for step in range(3):
            batch = _ids_with_multiples_of_three(step + 1)  # depth 2, 1, 2
            # After step 0's backward the capture was tried and failed; nothing is trained yet.
            unchanged = (lambda: _assert_unchanged(lazy, before)) if step == 0 else None
            _step(lazy, eager, batch, lambda o: o[0], f"step {step}", after_backward=unchanged)
            _assert_sharing_holds(lazy)
            for opt in opts:
                opt.step()
            _assert_params_equal(lazy, eager, f"after step {step}")
    fallbacks = [w for w in record if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and stats.fallbacks == 0  # its own code eagerly, its parts in ORT
    _assert_sharing_holds(lazy)
    assert list(lazy.state_dict().keys()) == before["state_dict_keys"]
    for name, (obj, _) in before["parameters"].items():
        assert dict(lazy.named_parameters(remove_duplicate=False))[name] is obj, name


# ---------------------------------------------------------------------------------------------
# 5. Routing over nonzero() is never baked into a graph


class LoopRoutedMoE(torch.nn.Module):
    """Mixtral-style dispatch: a Python loop over the experts that received tokens."""

    def __init__(self, dim: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        with torch.no_grad():  # expert e is chosen by a large feature e: tests pick the routing
            self.router.weight.copy_(2.0 * torch.eye(experts, dim))
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x):
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            rows = torch.nonzero(choice == e).squeeze(-1)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * gates[rows, e : e + 1])
        return out


def _routed_tokens(route: list[int], seed: int, dim: int = 6) -> torch.Tensor:
    x = 0.1 * torch.randn(len(route), dim, generator=torch.Generator().manual_seed(seed))
    x[torch.arange(len(route)), torch.tensor(route)] += 3.0
    return x


# Its graph breaks: tests/test_graph_breaks.py


# ---------------------------------------------------------------------------------------------
# 6. Plain Python attributes read by forward


class Configurable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(5, 5)
        self.outer = torch.nn.Linear(5, 5)
        self.scale = 2.0
        self.use_residual = True

    def forward(self, x):
        h = torch.tanh(self.inner(x)) * self.scale
        if self.use_residual:
            h = h + x
        return self.outer(h)


def test_changing_a_python_attribute_read_by_forward_changes_the_result_as_in_eager():
    torch.manual_seed(0)
    eager = Configurable()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    probe = torch.randn(4, 5, generator=generator)
    previous = None
    for scale, use_residual in [(2.0, True), (3.0, True), (3.0, False), (2.0, True)]:
        what = f"scale={scale} residual={use_residual}"
        for m in (lazy, eager):
            m.scale, m.use_residual = scale, use_residual
        for step in range(3):
            x = torch.randn(4, 5, generator=generator)
            _step(lazy, eager, (x,), lambda o: o.square().sum(), f"{what} step {step}")
        with torch.no_grad():
            got = lazy(probe)
            assert_close(got, eager(probe), f"{what} probe")
        if previous is not None:  # the attribute did change the result
            assert not torch.allclose(got, previous), what
        previous = got
    assert lazygrad.stats(lazy).fallbacks == 0


# ---------------------------------------------------------------------------------------------
# 7. BatchNorm in training mode


class SmallConvNet(torch.nn.Module):
    """torchvision-style: strided convolution, BatchNorm, max pooling, a grouped convolution,
    GroupNorm, adaptive average pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm (as in ResNets): its gradient is zero up to rounding noise.
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        h = torch.relu(self.gn(self.grouped(h)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


def _assert_bn_state_equal(lazy: SmallConvNet, eager: SmallConvNet, what: str) -> None:
    assert_close(lazy.bn.running_mean, eager.bn.running_mean, f"{what}: running_mean")
    assert_close(lazy.bn.running_var, eager.bn.running_var, f"{what}: running_var")
    assert torch.equal(lazy.bn.num_batches_tracked, eager.bn.num_batches_tracked), what


def test_batchnorm_training_updates_running_stats_like_eager_then_eval_matches():
    torch.manual_seed(0)
    eager = SmallConvNet()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    running_mean = lazy.bn.running_mean
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (lazy, eager)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 12, 12, generator=generator) + step
        _step(lazy, eager, (x,), lambda o: o.square().sum(), f"step {step}", opts)
        _assert_bn_state_equal(lazy, eager, f"step {step}")
        _assert_params_equal(lazy, eager, f"after step {step}")
    assert int(lazy.bn.num_batches_tracked) == 3
    assert lazy.bn.running_mean is running_mean  # updated in place, as eager does
    for m in (lazy, eager):
        m.eval()
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(5, 3, 12, 12, generator=generator)
            assert_close(lazy(x), eager(x), f"eval call {step}")
    _assert_bn_state_equal(lazy, eager, "after eval")
    assert lazygrad.stats(lazy).fallbacks == 0


# ---------------------------------------------------------------------------------------------
# 8. Argument checks on values (torch.distributions' validate_args)


class GaussianEncoder(torch.nn.Module):
    """A VAE's encoder and loss: `Normal` checks its scale is positive and its mean a number,
    `log_prob` that the action is in `Categorical`'s support, each a branch on values."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(8, 8)
        self.decode = torch.nn.Linear(4, 8)
        self.policy = torch.nn.Linear(4, 3)

    def forward(self, x, action, scale_shift):
        mean, log_scale = self.encode(x).chunk(2, -1)
        posterior = torch.distributions.Normal(mean, log_scale.exp() + scale_shift)
        z = posterior.rsample()
        prior = torch.distributions.Normal(torch.zeros_like(mean), torch.ones_like(mean))
        kl = torch.distributions.kl_divergence(posterior, prior).sum(-1).mean()
        policy = torch.distributions.Categorical(logits=self.policy(z))
        return F.mse_loss(self.decode(z), x) + kl - policy.log_prob(action).mean(), z


def test_distributions_checks_run_in_the_graph_and_a_failed_one_raises_eagers_error():
    """The model ran in parts. Its checks are results of the graph now: a call where one fails
    runs again in eager PyTorch, which raises the distribution's own error, as without lazygrad."""
    torch.manual_seed(0)
    eager = GaussianEncoder()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(5, 8, generator=generator)
        action = torch.randint(0, 3, (5,), generator=generator)
        for model in (lazy, eager):
            torch.manual_seed(step)  # the same draws for rsample
            model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss, z = lazy(x, action, torch.zeros(()))
        torch.manual_seed(step)
        expected_loss, expected_z = eager(x, action, torch.zeros(()))
        assert_close(loss.detach(), expected_loss.detach(), f"step {step} loss")
        assert_close(z.detach(), expected_z.detach(), f"step {step} sample")
        loss.backward()
        expected_loss.backward()
        assert_grads_equal(lazy, eager, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert (stats.hits, stats.fallbacks, stats.breaks) == (2, 0, 0), stats.reasons
    # A check that fails in the graph: the call runs eagerly and raises eager's error (no step:
    # it counts for nothing); the graphs still serve the next calls.
    negative_scale = torch.tensor(-10.0)
    with pytest.raises(ValueError) as expected:
        eager(x, action, negative_scale)
    said = str(expected.value).split("(")[0]
    with pytest.raises(ValueError, match=said):
        lazy(x, action, negative_scale)
    assert lazygrad.stats(lazy).eager_steps == stats.eager_steps
    with torch.no_grad():
        for _ in range(2):  # the inference graph: built, then serving
            lazy(x, action, torch.zeros(()))
        with pytest.raises(ValueError, match=said):
            lazy(x, action, negative_scale)
    assert lazygrad.stats(lazy).eager_steps == stats.eager_steps + 1  # the inference's first
    with pytest.raises(ValueError):  # outside Categorical's support: ORT's gather fails first
        lazy(x, torch.full((5,), 3), torch.zeros(()))
    lazy(x, action, torch.zeros(()))[0].backward()
    after = lazygrad.stats(lazy)
    assert (after.fallbacks, after.breaks) == (0, 0), after.reasons
    # through ORT: the last training call, and two inference calls (the second one failed)
    assert sum(entry.hits for entry in after.entries) == stats.hits + 3


def test_a_tensor_attribute_read_before_the_call_writes_it_is_refused():
    """A state kept from call to call (read, then replaced) would be a constant of the graph:
    the value it had at the trace, where each eager call reads the last call's."""
    from lazygrad.capture import CaptureError, refuse_reads

    previous = torch.ones(2)
    gm = torch.fx.symbolic_trace(lambda x: x + previous)  # the old value, as a constant
    with pytest.raises(CaptureError, match="'state.previous' and then replaces it"):
        refuse_reads(gm, {"state.previous": previous})
    refuse_reads(gm, {"state.previous": torch.zeros(2)})  # another tensor: fine


class KeepsItsRecurrentState(torch.nn.Module):
    """Truncated backpropagation through time, the state kept on the module: each call reads
    the last call's state and writes its own."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.GRUCell(4, 4)
        self.state = None

    def forward(self, x):
        state = self.cell(x, self.state)
        self.state = state.detach()
        return state


@pytest.mark.falls_back  # in parts: its state is read before it is written
def test_a_state_read_from_the_last_call_is_never_baked_into_a_graph():
    torch.manual_seed(0)
    eager = KeepsItsRecurrentState()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(6):
        _step(lazy, eager, (torch.randn(3, 4),), lambda o: o.square().sum(), f"step {step}")
        assert_close(lazy.state, eager.state, f"step {step} state")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and "'state' and then replaces it" in stats.reasons[0]
    assert stats.parts["cell"].hits >= 1


class RenormsItsWeight(torch.nn.Module):
    """A max-norm constraint applied in the forward by replacing a parameter's `.data`."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        with torch.no_grad():
            self.hidden.weight.data = torch.renorm(self.hidden.weight.data, 2, 0, 0.5)
        return self.head(torch.relu(self.hidden(x)))


@pytest.mark.falls_back  # in parts
def test_a_parameters_data_replaced_in_the_forward_is_never_dropped_by_a_graph():
    """AOTAutograd's trace drops a `.data` assignment: the graph computed with the weight as
    it was, and ORT steps never renormed it (outputs 0.8 off, silently)."""
    torch.manual_seed(0)
    eager = RenormsItsWeight()
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (lazy, eager)]
    for step in range(4):
        _step(lazy, eager, (torch.randn(4, 8),), lambda o: o.square().sum(), f"step {step}",
              optimizers)
        _assert_params_equal(lazy, eager, f"after step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.breaks == 1 and "replaces the `.data` of hidden.weight" in stats.reasons[0]
    assert stats.parts["head"].hits >= 1

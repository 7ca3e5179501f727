"""Hugging Face models built from small configs (no download), against eager, per loss composition.

Optional: needs the `hf` extra (`pip install -e ".[hf]"`); skipped without transformers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lazygrad  # noqa: E402


def _assert_grads_match(lazy: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    """Relative to the largest gradient of the model: some gradients are zero in exact arithmetic
    (attention key biases cancel in the softmax) and only rounding noise in both runs."""
    scale = max(q.grad.abs().max().item() for q in eager.parameters() if q.grad is not None)
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}"
        if q.grad is not None:
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-4, atol=1e-6 * scale, msg=lambda m, n=name: f"{what} {n}"
            )


def _bert() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForPreTraining(config)  # default attention (SDPA)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (2, 10), generator=generator)
    labels = torch.where(torch.rand(2, 10, generator=generator) < 0.3, ids, -100)
    labels[:, 1] = ids[:, 1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "next_sentence_label": torch.tensor([0, 1])}
    return model, batch


BERT_COMPOSITIONS = {
    "loss": lambda o: o.loss,
    "loss+prediction_logits": lambda o: o.loss + 0.01 * o.prediction_logits.sum(),
    "seq_relationship_logits": lambda o: o.seq_relationship_logits.pow(2).sum(),
    "all": lambda o: o.loss + o.prediction_logits.mean() + o.seq_relationship_logits.sum(),
}


def test_bert_for_pretraining_every_loss_composition_matches_eager():
    model, batch = _bert()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        for what, compose in BERT_COMPOSITIONS.items():
            for m in (lazy, model):
                m.zero_grad(set_to_none=True)
            out, expected = lazy(**batch), model(**batch)
            assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
            for key in expected:
                torch.testing.assert_close(out[key].detach(), expected[key].detach(),
                                           rtol=1e-5, atol=1e-5, msg=lambda m, k=key: k)
            compose(out).backward()
            compose(expected).backward()
            _assert_grads_match(lazy, model, what)
    stats = lazygrad.stats(lazy)
    assert stats.exports == 1 and stats.fallbacks == 0
    assert stats.misses == 4 and stats.eager_steps == 1  # one pair per composition's mask


def _moe_model(kind: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_experts_per_tok=2, output_router_logits=True, use_cache=False,
    )
    if kind == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **common))
    else:
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, **common))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _moe_loss(step: int):
    """The router's auxiliary loss joins every third step (`loss` includes it)."""
    if step % 3 == 2:
        return lambda o: o.loss
    return lambda o: o.logits.logsumexp(-1).mean()


def _moe_steps(lazy: torch.nn.Module, model: torch.nn.Module, batch: dict, steps: int) -> None:
    """Train both on `_moe_loss`: outputs, the auxiliary loss and gradients eager's at every
    step."""
    for step in range(steps):
        for m in (lazy, model):
            m.zero_grad(set_to_none=True)
        out, expected = lazy(**batch), model(**batch)
        for key in ("logits", "loss", "aux_loss"):
            torch.testing.assert_close(out[key].detach(), expected[key].detach(),
                                       rtol=1e-4, atol=1e-5, msg=lambda m, k=key: k)
        _moe_loss(step)(out).backward()
        _moe_loss(step)(expected).backward()
        _assert_grads_match(lazy, model, f"step {step}")


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_moe_runs_whole_through_ort_and_matches_eager(kind):
    """Mixture-of-Experts LMs dispatch tokens to experts by the router's choices: transformers
    5 sorts the (token, expert) rows by expert and calls its own `grouped_mm` op on them, whose
    group sizes are data. Translated (capture/grouped_mm.py), with everything else of the
    routing (sort, histc, cumsum, gathers and their scatter-add gradients), the whole model
    is captured: no break, no fallback, eager's outputs and gradients at every step, and two
    graphs per signature (with and without the auxiliary loss), not one per step."""
    model, batch = _moe_model(kind)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        _moe_steps(lazy, model, batch, 6)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and not stats.parts, stats.reasons
    # Its first call sets a Python attribute (its output hooks installed): nothing is built for
    # the signature that call started with, one signature serves the rest.
    masks: dict[str, set] = {}
    for entry in stats.entries:
        masks.setdefault(entry.forward, set()).add(entry.mask)
    assert sorted(len(m) for m in masks.values()) == [2], masks
    assert stats.builds + stats.disk_hits == len(stats.entries) and stats.hits >= 3
    assert stats.ort_share > 0


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_moe_decoder_layers_run_as_parts_under_the_models_output_recorder_as_in_eager(kind):
    """A counting hook of the user's on the final norm sends the model to its parts, and the
    decoder model to its own (embeddings, layers, norm). Each layer is then a part under the
    decoder's output recorder: transformers' hook on the router files the router logits in a
    collector of the decoder's call, which the auxiliary loss reads. Captured whole, a layer's
    ORT steps would skip that hook (the collector stayed empty and the loss raised); watched
    at its first call, the layer goes to its parts down to the router, whose hook wraps its
    own lazy call. Outputs, the auxiliary loss and gradients are eager's at every step (the
    parts settle over the first steps), and the counter counts eager's calls."""
    model, batch = _moe_model(kind)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    counts = []
    for m in (lazy, model):
        count: list[int] = []
        m.model.norm.register_forward_hook(lambda module, args, out, c=count: c.append(1))
        counts.append(count)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("ignore", lazygrad.GraphBreakWarning)  # a FallbackWarning's kind
        _moe_steps(lazy, model, batch, 9)
    assert counts[0] == counts[1] == [1] * 9
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks >= 1
    layer = stats.parts["model.layers.0"]
    assert layer.breaks == 1 and "keeps 1 tensor(s)" in layer.reasons[0], layer.reasons
    # The router and the experts serve steps through ORT once built (the router with and
    # without the auxiliary loss: two masks).
    for part in ("model.layers.0.mlp.gate", "model.layers.0.mlp.experts"):
        assert stats.parts[part].hits >= 1 and stats.parts[part].fallbacks == 0, part


def test_mistral_with_its_sliding_window_cache_runs_whole_through_ort():
    """Mistral returns a sliding-window cache whose layers count the positions they saw
    (`cumulative_length`, a size): each call's cache holds its own count (it ran in parts
    before, its own code in eager PyTorch), and its keys are views of a projection."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=4,
    )
    model = transformers.MistralForCausalLM(config)
    lazy = lazygrad.lazy(copy.deepcopy(model))
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        for step, length in enumerate([6, 6, 9, 6]):
            ids = torch.randint(0, 64, (2, length), generator=generator)
            for m in (lazy, model):
                m.zero_grad(set_to_none=True)
            out, expected = lazy(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
            torch.testing.assert_close(out.loss.detach(), expected.loss.detach())
            for got, want in zip(out.past_key_values.layers, expected.past_key_values.layers):
                assert got.cumulative_length == want.cumulative_length == length
                torch.testing.assert_close(got.keys.detach(), want.keys.detach())
            out.loss.backward()
            expected.loss.backward()
            _assert_grads_match(lazy, model, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0, stats.reasons
    assert stats.hits >= 2


def test_trainer_feeds_a_lazy_model_the_batch_columns_and_trains_it_like_eager(tmp_path):
    """Hugging Face's Trainer keeps the batch columns the model's forward names (inspected):
    with a lazy instance's `(*args, **kwargs)` it kept none, and the model got no input ids."""
    pytest.importorskip("accelerate")  # the Trainer's own requirement
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, max_position_embeddings=32,
    )
    eager = transformers.BertForSequenceClassification(config)
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    rows = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 100, (16,), generator=rows),
             "attention_mask": (torch.arange(16) < 10 + i % 6).long(),
             "labels": torch.tensor(i % 3)} for i in range(32)]
    results = []
    for model, folder in ((eager, "eager"), (lazy, "lazy")):
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / folder), per_device_train_batch_size=8,
            num_train_epochs=1, learning_rate=1e-3, gradient_accumulation_steps=2,
            report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=data)
        results.append((trainer.train().training_loss, trainer.evaluate(data)["eval_loss"]))
    (train_eager, eval_eager), (train_lazy, eval_lazy) = results
    assert abs(train_lazy - train_eager) <= 1e-5 * abs(train_eager)
    assert abs(eval_lazy - eval_eager) <= 1e-5 * abs(eval_eager)
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: n)
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.hits > 0, str(stats)


def test_deberta_with_dropout_runs_whole_through_ort_and_matches_eager():
    """DeBERTa slices its relative-position table by `torch.tensor(min(length, span))`: the
    trace read that bound back as unknown data, and the model ran in parts (every attention
    layer eagerly). With every dropout on, under the same seeds, the steps are eager's."""
    torch.manual_seed(0)
    config = transformers.DebertaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, relative_attention=True,
        pos_att_type=["p2c", "c2p"],
    )
    model = transformers.DebertaForMaskedLM(config).train()
    lazy = lazygrad.lazy(copy.deepcopy(model), wait_for_builds=True)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        for step in range(3):
            losses = []
            for m in (lazy, model):
                torch.manual_seed(step)
                m.zero_grad(set_to_none=True)
                out = m(**batch)
                out.loss.backward()
                losses.append(out.loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            _assert_grads_match(lazy, model, f"step {step}")
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 2, stats.reasons


def test_bert_with_gradient_checkpointing_runs_whole_and_saves_what_eager_saves():
    """`gradient_checkpointing_enable()`: traced as plain code, the layers' activations were
    all saved (44.4 MiB where eager saves 2.6, on a 4-layer BERT); its regions are now
    recomputed in the backward. And the sum of the last hidden state has gradients that are
    zero in exact arithmetic (what feeds a LayerNorm, summed over its outputs): rounding noise,
    which ORT and torch make differently beyond the check's tolerance, so the model ran in
    parts. Such a difference is now judged against the graph run in float64."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config).train()
    model.gradient_checkpointing_enable()
    lazy = lazygrad.lazy(copy.deepcopy(model), wait_for_builds=True)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(0))
    activation = ids.numel() * config.hidden_size * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        for step in range(3):
            outputs, saved = [], []
            for m in (lazy, model):
                m.zero_grad(set_to_none=True)
                activations = [0]

                def pack(tensor, activations=activations):  # the activations saved
                    if tensor.numel() * tensor.element_size() >= activation and \
                            not isinstance(tensor, torch.nn.Parameter):
                        activations[0] += tensor.numel() * tensor.element_size()
                    return tensor

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = m(input_ids=ids).last_hidden_state
                out.sum().backward()
                outputs.append(out.detach())
                saved.append(activations[0])
            torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
            _assert_grads_match(lazy, model, f"step {step}")
            # each layer's input, and the embeddings' LayerNorm's
            assert saved[0] == saved[1] == (config.num_hidden_layers + 1) * activation
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0 and stats.breaks == 0 and stats.hits == 2, stats.reasons


def test_bert_layers_made_lazy_under_gradient_checkpointing_run_through_ort_like_eager():
    """The layers of a Hugging Face BERT made lazy, which the model checkpoints
    (`gradient_checkpointing_enable()`, non-reentrant; dropout 0.1), as a user who makes a
    model's layers lazy does. transformers 5 checkpoints inside each layer's own forward, so
    each lazy layer traces its region (the checkpoint of a lazy module called from outside:
    `tests/test_memory_paths.py`). Losses and gradients eager's (the recomputation's dropout
    draws the forward's), every layer through ORT from step 2."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64)
    eager = transformers.BertForMaskedLM(config).train()
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lazy = copy.deepcopy(eager)
    for layer in lazy.bert.encoder.layer:
        lazygrad.lazy(layer, wait_for_builds=True)
    ids = torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        warnings.simplefilter("error", lazygrad.GraphBreakWarning)
        for step in range(3):
            losses = []
            for m in (lazy, eager):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                losses.append(m(input_ids=ids, labels=ids).loss)
                losses[-1].backward()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            _assert_grads_match(lazy, eager, f"step {step}")
    for layer in lazy.bert.encoder.layer:
        stats = lazygrad.stats(layer)
        assert stats.hits == 2 and stats.fallbacks == 0 and stats.breaks == 0, stats


class TakesACache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, past_key_values=None):
        return self.linear(x)


def test_a_call_with_a_cache_runs_eagerly_and_says_how_to_avoid_it():
    """A decoder layer that runs as a part is handed the cache its model fills while
    `use_cache` is on: an object argument, so its calls run eagerly (Llama 4's and Qwen3-Next's
    layers, whose models run in parts). The warning says how training avoids it."""
    lazy = lazygrad.lazy(TakesACache())
    with pytest.warns(lazygrad.FallbackWarning, match=r"a DynamicCache\).*use_cache=False"):
        lazy(torch.randn(2, 4), past_key_values=transformers.DynamicCache()).sum().backward()


@pytest.mark.falls_back  # in parts: its sparse attention's result depends on a top-k's order
def test_informer_sparse_attention_trains_like_eager_its_order_dependent_top_k_refused():
    """Informer's ProbSparse attention picks queries with `topk(sorted=False)` and applies its
    Dropout mask to them in that order, which eager's kernel chooses. Taken as the sorted
    top-k, a decoder layer whose forward passed the first call's comparison with eager ran
    through ORT with other gradients (0.18 relative at its first ORT step). The check now
    rotates the picks and refuses the graphs, naming why; every step is eager's."""
    config = transformers.InformerConfig(
        prediction_length=4, context_length=16, input_size=1, lags_sequence=[1, 2, 3],
        num_time_features=1, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, attention_type="prob", encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    torch.manual_seed(0)
    eager = transformers.InformerForPrediction(config).train()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    times = torch.arange(23, dtype=torch.float32)[None, :, None].repeat(2, 1, 1) / 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):
            generator = torch.Generator().manual_seed(100 + step)
            batch = dict(past_values=torch.randn(2, 19, generator=generator),
                         past_time_features=times[:, :19], past_observed_mask=torch.ones(2, 19),
                         future_values=torch.randn(2, 4, generator=generator),
                         future_time_features=times[:, 19:])
            losses = []
            for model in (lazy, eager):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                losses.append(model(**batch).loss)
                losses[-1].backward()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            _assert_grads_match(lazy, eager, f"step {step}")
    reasons = lazygrad.stats(lazy).reasons
    assert any("depends on the order of a `topk(sorted=False)`'s picks" in r for r in reasons)


def test_ibert_keeps_its_quantization_ranges_as_eager_updates_them():
    """I-BERT's `QuantAct` assigns its range buffers anew at every call (`self.x_min = ...`),
    even with `quant_mode` off: the trace's restore of the module's tensors dropped the
    assignment, and every ORT step kept the ranges of the first call, silently."""
    config = transformers.IBertConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    eager = transformers.IBertForMaskedLM(config).train()
    with torch.no_grad():  # a first call: the ranges leave their all-zero start
        eager(input_ids=torch.randint(3, 300, (2, 16)))
    lazy = lazygrad.lazy(copy.deepcopy(eager), wait_for_builds=True)
    for step in range(4):
        ids = torch.randint(3, 300, (2, 16))
        losses = []
        for model in (lazy, eager):
            model.zero_grad(set_to_none=True)
            losses.append(model(input_ids=ids, labels=ids).loss)
            losses[-1].backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        _assert_grads_match(lazy, eager, f"step {step}")
        for (name, got), wanted in zip(lazy.named_buffers(), eager.buffers()):
            torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=step: f"step {s} buffer {n}")
    stats = lazygrad.stats(lazy)
    assert (stats.fallbacks, stats.breaks) == (0, 0) and stats.hits == 3

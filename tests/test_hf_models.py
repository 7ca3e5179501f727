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


def _olmoe() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True, use_cache=False,
        attn_implementation="eager",  # with "sdpa" the export fails on is_causal (a traced size)
    )
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    return transformers.OlmoeForCausalLM(config), {"input_ids": ids, "labels": ids}


MOE_COMPOSITIONS = {
    "task loss": lambda o: o.loss,  # includes router_aux_loss_coef * aux_loss
    "aux loss only": lambda o: o.aux_loss,
    "logits + 0.01 aux": lambda o: o.logits.logsumexp(-1).mean() + 0.01 * o.aux_loss,
}


@pytest.mark.falls_back
def test_moe_with_router_aux_loss_falls_back_once_and_matches_eager():
    """OLMoE dispatches tokens to experts by the router's choices: transformers 4 loops over the
    experts that were hit (sizes from `nonzero()`, data-dependent), transformers 5 calls its own
    `grouped_mm` op (no ONNX translation). Either way the model runs in eager PyTorch with one
    warning naming the reason, and gradients are eager's. (Its first call also sets a Python
    attribute, so the second call is a second signature: counted, not warned about again.)"""
    model, batch = _olmoe()
    lazy = lazygrad.lazy(copy.deepcopy(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for what, compose in MOE_COMPOSITIONS.items():
            for m in (lazy, model):
                m.zero_grad(set_to_none=True)
            out, expected = lazy(**batch), model(**batch)
            torch.testing.assert_close(out.aux_loss.detach(), expected.aux_loss.detach())
            torch.testing.assert_close(out.loss.detach(), expected.loss.detach())
            compose(out).backward()
            compose(expected).backward()
            _assert_grads_match(lazy, model, what)
    fallbacks = [w for w in caught if issubclass(w.category, lazygrad.FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    message = str(fallbacks[0].message)
    assert "OlmoeForCausalLM" in message
    assert "depends on tensor values" in message or "grouped_mm" in message
    assert lazygrad.stats(lazy).fallbacks >= 1

"""Hugging Face decoder-only LMs (GPT-2, Llama) from tiny configs: through ORT, trained like eager.

transformers builds their causal and padding masks in `masking_utils` (with `torch.vmap` in some
versions, and reading the padding mask's values to decide whether SDPA may skip it) and attends
with SDPA by default; the capture must trace all of it. No downloads: random weights from small
configs. Skipped without transformers (the `hf` extra).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_close, assert_grads_equal

transformers = pytest.importorskip("transformers")

import lazygrad  # noqa: E402
from lazygrad.outputs import tensors_of  # noqa: E402

VOCAB, BATCH, SEQ = 100, 2, 8


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)  # lm_head tied to the token embedding


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


# (factory, which side is padded): each model sees a batch with padding in its attention mask.
MODELS = {"gpt2": (_gpt2, "right"), "llama": (_llama, "left")}

COMPOSITIONS = {
    "loss": lambda o: o.loss,
    "loss+logits": lambda o: o.loss + 1e-3 * o.logits.pow(2).mean(),
}


def _batch(step: int, padding: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    attention_mask = torch.ones_like(ids)
    if padding == "left":
        attention_mask[0, :3] = 0
    else:
        attention_mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": attention_mask, "labels": ids}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decoder_lm_with_padding_runs_through_ort_and_trains_like_eager(name):
    factory, padding = MODELS[name]
    torch.manual_seed(0)
    eager = factory()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (lazy, eager)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", lazygrad.FallbackWarning)
        for what, compose in COMPOSITIONS.items():
            for step in range(3):
                where = f"{name} {what} step {step}"
                batch = _batch(step, padding)
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                out, expected = lazy(**batch), eager(**batch)
                assert type(out) is type(expected), where
                # The default config's key/value cache (a DynamicCache object) comes back too.
                assert list(out.keys()) == list(expected.keys()), where
                assert out.past_key_values is not None, where
                assert type(out.past_key_values) is type(expected.past_key_values), where
                assert_close(out.loss.detach(), expected.loss.detach(), f"{where}: loss")
                assert_close(out.logits.detach(), expected.logits.detach(), f"{where}: logits")
                cache, expected_cache = (
                    tensors_of(o.past_key_values) for o in (out, expected)
                )
                assert len(cache) == len(expected_cache) == 4, where  # keys, values x 2 layers
                for got, want in zip(cache, expected_cache):
                    assert_close(got.detach(), want.detach(), f"{where}: cached keys/values")
                compose(out).backward()
                compose(expected).backward()
                assert_grads_equal(lazy, eager, where)
                for opt in opts:
                    opt.step()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 0
    assert stats.exports == 1, "one input signature"
    assert stats.builds == len(COMPOSITIONS), "one graph pair per grad mask"
    if name == "gpt2":
        assert lazy.lm_head.weight is lazy.transformer.wte.weight


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_with_its_key_value_cache_gives_eagers_tokens(name):
    """`generate` hands the forward a `DynamicCache` that each call appends to. A trace baked
    the cache's tensors in and left trace tensors in the caller's cache (a crash at the second
    token); calls with it now run eagerly, said once."""
    factory, _ = MODELS[name]
    torch.manual_seed(0)
    eager = factory().eval()
    lazy = lazygrad.lazy(copy.deepcopy(eager))
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    settings = {"max_new_tokens": 6, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
    expected = eager.generate(prompt, **settings)
    with pytest.warns(lazygrad.FallbackWarning, match=r"\(a DynamicCache\)"):
        first = lazy.generate(prompt, **settings)
    assert first.tolist() == expected.tolist()
    assert lazy.generate(prompt, **settings).tolist() == expected.tolist()
    stats = lazygrad.stats(lazy)
    assert stats.fallbacks == 1 and stats.builds == 0

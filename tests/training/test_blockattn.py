"""Causal attention in query blocks (training/speed/blockattn.py): the same outputs and gradients as torch's sdpa, and
transformers' sdpa wherever the blocks do not apply (padding masks, dropout, a KV cache)."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import tiny_gpt2

from training.speed import blockattn


@pytest.mark.parametrize("tokens,block", [(45, 16), (64, 16), (10, 128)])  # a short last block; even; one block
def test_it_equals_sdpa_causal_in_output_and_gradients(tokens, block):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, tokens, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((ref * out).sum(), (q, k, v))
    got = blockattn.causal_attention(q, k, v, 0.3, block=block)
    assert torch.allclose(got, ref, atol=1e-10)
    for a, b in zip(torch.autograd.grad((got * out).sum(), (q, k, v)), want):
        assert torch.allclose(a, b, atol=1e-10)


def _count_calls(monkeypatch) -> list:
    calls, real = [], blockattn.causal_attention
    monkeypatch.setattr(blockattn, "causal_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    return calls


def test_a_gpt2_trains_with_the_blocks_as_with_sdpa(monkeypatch):
    model = tiny_gpt2(n_head=4)
    ours = copy.deepcopy(model)
    assert blockattn.install(ours) and ours.config._attn_implementation == blockattn.NAME
    ids = torch.randint(0, 300, (3, 50), generator=torch.Generator().manual_seed(1))
    calls = _count_calls(monkeypatch)
    got = ours(input_ids=ids, labels=ids)
    want = model(input_ids=ids, labels=ids)
    assert len(calls) == 2  # one per layer: the blocks ran, not sdpa
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    got.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(ours.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def test_a_padding_mask_goes_to_sdpa_with_the_same_result(monkeypatch):
    model = tiny_gpt2(n_head=4)
    ours = copy.deepcopy(model)
    blockattn.install(ours)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    calls = _count_calls(monkeypatch)
    got = ours(input_ids=ids, attention_mask=mask).logits
    assert calls == []
    assert torch.allclose(got, model(input_ids=ids, attention_mask=mask).logits, atol=1e-5)


def test_generation_with_a_cache_goes_to_sdpa():
    model = tiny_gpt2(n_head=4)
    ours = copy.deepcopy(model)
    blockattn.install(ours)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kw), model.generate(ids, **kw))


def test_it_leaves_a_model_without_sdpa_alone():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2),
        attn_implementation="eager")
    assert not blockattn.install(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("value,flags,cap,want", [
    ("auto", {"avx512_bf16", "avx512f"}, None, True),  # no AMX: the blocks (measured faster there)
    ("auto", {"amx_bf16", "amx_tile", "avx512_bf16"}, None, False),  # AMX: torch's flash kernel
    ("auto", {"amx_bf16", "amx_tile", "avx512_bf16"}, "AVX512_CORE_BF16", True),  # oneDNN capped below AMX
    ("True", {"amx_bf16", "amx_tile"}, None, True), ("false", set(), None, False)])
def test_block_attention_auto_follows_amx(monkeypatch, value, flags, cap, want):
    from training.speed import levers, mfu

    monkeypatch.setattr(mfu, "cpu_flags", lambda: flags)
    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert levers.block_attention(value) is want


def test_block_attention_rejects_other_words():
    from training.speed import levers

    with pytest.raises(ValueError, match="auto, True, False"):
        levers.block_attention("sometimes")

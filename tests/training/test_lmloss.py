"""The causal LM's chunked head and loss (training/speed/lmloss.py) and the clm levers (training/speed/levers.py): the same
loss and gradients as transformers' full-logits path, without the full logits."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import tiny_gpt2

from training.speed import levers, lmloss, speedup


def _inputs(rows=300, width=48, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::7] = lmloss.IGNORE
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [64, 1000])  # several chunks with a short last one; one chunk
@pytest.mark.parametrize("items", [None, 250])  # a mean over the labelled rows; a sum over the Trainer's count
def test_it_equals_cross_entropy_of_the_full_logits_in_loss_and_gradients(chunk, items):
    hidden, weight, labels = _inputs()
    ref = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, ignore_index=lmloss.IGNORE,
                                            reduction="mean" if items is None else "sum")
    ref = ref if items is None else ref / items
    ref.backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = lmloss.linear_cross_entropy(hidden, weight, labels, items, chunk=chunk)
    (got * 3.0).backward()  # a scale after the loss (gradient accumulation) reaches both gradients
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, 3 * want[0], rtol=1e-4, atol=1e-7)
    assert torch.allclose(weight.grad, 3 * want[1], rtol=1e-4, atol=1e-7)
    assert (hidden.grad[::7] == 0).all()  # an ignored token has no gradient


def test_under_bf16_autocast_it_matches_the_head_autocast_would_run():
    hidden, weight, labels = _inputs(rows=256, width=64, vocab=2000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=lmloss.IGNORE)
        got = lmloss.linear_cross_entropy(hidden, weight, labels, chunk=100)
    assert abs(got.item() - ref.item()) < 1e-3
    got.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32  # as the leaves are
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    assert (hidden.grad - ref_h).norm() / ref_h.norm() < 2e-2  # bf16 matmuls on both sides
    assert (weight.grad - ref_w).norm() / ref_w.norm() < 2e-2


def test_without_grad_it_gives_the_loss_alone():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        got = lmloss.linear_cross_entropy(hidden, weight, labels, chunk=64)
        ref = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, ignore_index=lmloss.IGNORE)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)


def test_a_gpt2_with_the_chunked_loss_trains_as_transformers_own_loss_does():
    model = tiny_gpt2()
    ours = copy.deepcopy(model)
    assert lmloss.install(ours)
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 30:] = lmloss.IGNORE
    want, got = model(input_ids=ids, labels=labels), ours(input_ids=ids, labels=labels)
    assert got.logits is None and want.logits.shape == (3, 40, 300)  # no logits held for the loss
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    want.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(model.named_parameters(), ours.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name  # the tied head/embedding included
    n = 11  # the Trainer's token count across ranks: a sum over it, as transformers' loss does
    assert ours(input_ids=ids, labels=labels, num_items_in_batch=n).loss.item() == pytest.approx(
        model(input_ids=ids, labels=labels, num_items_in_batch=n).loss.item(), rel=1e-6)
    assert torch.equal(ours(input_ids=ids).logits, model(input_ids=ids).logits)  # without labels: logits


def test_the_clm_levers_fuse_gelu_drop_attention_dropout_and_keep_the_function():
    args = type("A", (), {"attention_dropout": 0.0, "fused_gelu": True, "fast_dropout": True, "chunked_loss": True})
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    levers.causal_lm_config(config, args)
    assert config.attn_pdrop == 0.0 and config.activation_function == "gelu_pytorch_tanh"
    x = torch.randn(1000)
    fused = transformers.activations.ACT2FN["gelu_pytorch_tanh"](x)
    assert torch.allclose(fused, transformers.activations.ACT2FN["gelu_new"](x), atol=1e-6)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    applied = speedup.causal_lm(model, args)
    assert applied["chunked_loss"] and applied["fast_dropout"] > 0 and applied["attention_dropout"] == 0.0
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    keep = type("A", (), {"attention_dropout": None, "fused_gelu": False})
    config = transformers.GPT2Config()
    levers.causal_lm_config(config, keep)
    assert config.attn_pdrop == 0.1 and config.activation_function == "gelu_new"

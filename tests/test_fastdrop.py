"""The glue job's dropout (training/fastdrop.py): torch's statistics and semantics at a fraction of its CPU cost."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from training import fastdrop


def test_it_keeps_one_minus_p_scales_the_rest_and_follows_the_seed():
    x = torch.ones(4_000_000)
    torch.manual_seed(1)
    y = fastdrop.dropout(x, 0.1)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.9) < 1e-3  # 4M Bernoulli draws: the standard error is 1.5e-4
    assert torch.unique(y).tolist() == [0.0, pytest.approx(1 / 0.9)]
    assert abs(y.mean().item() - 1.0) < 2e-3  # the expectation is unchanged
    torch.manual_seed(1)
    assert torch.equal(fastdrop.dropout(x, 0.1), y)
    assert fastdrop.dropout(x, 0.1, training=False) is x and fastdrop.dropout(x, 0.0) is x
    with pytest.raises(ValueError, match="not in"):
        fastdrop.dropout(x, 1.0)


def test_a_bf16_activation_stays_bf16_and_drops_what_an_fp32_one_would():
    x = torch.randn(64, 384)
    torch.manual_seed(3)
    y32 = fastdrop.dropout(x, 0.1)
    torch.manual_seed(3)
    y16 = fastdrop.dropout(x.bfloat16(), 0.1)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16 == 0, y32 == 0)
    assert torch.allclose(y16.float(), y32, rtol=1e-2, atol=1e-2)


def test_its_gradient_flows_through_the_kept_elements_only():
    x = torch.randn(64, 32, requires_grad=True)
    y = fastdrop.dropout(x, 0.5)
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 2.0)) and (x.grad[~kept] == 0).all()


def _tiny_bert():
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification._from_config(config, attn_implementation="eager")


def test_installed_in_a_bert_it_changes_nothing_in_eval_padding_included():
    plain = _tiny_bert()
    fast = copy.deepcopy(plain)
    swapped = fastdrop.install(fast)
    assert swapped == sum(type(m) is torch.nn.Dropout for m in plain.modules()) > 0
    assert fast.config._attn_implementation == fastdrop.ATTENTION
    ids = torch.randint(5, 100, (4, 12))
    mask = torch.ones_like(ids)
    mask[:, 7:] = 0  # a custom attention without its mask function would attend to these
    plain.eval()
    fast.eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits, fast(input_ids=ids, attention_mask=mask).logits)
        changed = ids.clone()
        changed[:, 7:] = 3
        assert torch.equal(fast(input_ids=ids, attention_mask=mask).logits,
                           fast(input_ids=changed, attention_mask=mask).logits)  # padding is masked out
    fast.train()
    with torch.no_grad():
        a, b = (fast(input_ids=ids, attention_mask=mask).logits for _ in range(2))
    assert not torch.equal(a, b)  # dropout is on in training

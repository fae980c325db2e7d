"""The glue job's dropout (training/speed/fastdrop.py): torch's statistics and semantics at a fraction of its CPU cost."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from training.speed import fastdrop, native


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    """Each test on both paths: training/speed/native's kernel (built with gcc), and numpy's draws where it is not."""
    if request.param == "native":
        import shutil

        if shutil.which("gcc") is None:
            pytest.skip("no gcc on this machine: the native kernels are not built (the numpy path runs instead)")
    else:
        monkeypatch.setenv(native.ENV, "0")
    native.reset()
    yield request.param
    native.reset()


def test_it_keeps_one_minus_p_scales_the_rest_and_follows_the_seed(path):
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


def test_a_bf16_activation_stays_bf16_and_drops_what_an_fp32_one_would(path):
    x = torch.randn(64, 384)
    torch.manual_seed(3)
    y32 = fastdrop.dropout(x, 0.1)
    torch.manual_seed(3)
    y16 = fastdrop.dropout(x.bfloat16(), 0.1)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16 == 0, y32 == 0)
    assert torch.allclose(y16.float(), y32, rtol=1e-2, atol=1e-2)


def test_its_gradient_flows_through_the_kept_elements_only(path):
    x = torch.randn(64, 32, requires_grad=True)
    y = fastdrop.dropout(x, 0.5)
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 2.0)) and (x.grad[~kept] == 0).all()
    assert 0.45 < kept.float().mean().item() < 0.55


def test_the_native_mask_is_the_seeds_whatever_the_threads_layout_and_a_nan_stays_nan(path):
    if path != "native":
        pytest.skip("the native kernel's own properties")
    assert native.lib() is not None
    x = torch.randn(3, 50_001).bfloat16()  # not a whole number of 4-element words, nor of the kernel's blocks
    threads = torch.get_num_threads()
    masks = []
    for n in (1, 2):
        torch.set_num_threads(n)
        torch.manual_seed(5)
        masks.append(fastdrop.dropout(x, 0.1) == 0)
    torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    torch.manual_seed(5)
    transposed = fastdrop.dropout(x.t().contiguous().t(), 0.1)  # a strided input: copied, then the same mask
    assert transposed.is_contiguous() and torch.equal(transposed == 0, masks[0])
    torch.manual_seed(5)
    y = fastdrop.dropout(x, 0.1)
    kept = y != 0
    assert torch.equal(y[kept], (x[kept].float() * (1 / 0.9)).bfloat16())  # x / (1 - p) rounded once
    nan = torch.full((64,), float("nan"))
    assert fastdrop.dropout(nan, 0.5).isnan().all()  # x * 0 where dropped: a NaN is not hidden
    half = torch.ones(1000, dtype=torch.float16)  # a dtype the kernel lacks: numpy's path, same statistics
    assert fastdrop.dropout(half, 0.1).dtype == torch.float16


def _tiny_bert():
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification._from_config(config, attn_implementation="eager")


def test_installed_in_a_bert_it_changes_nothing_in_eval_padding_included(path):
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

"""An encoder layer's fused output blocks in bf16 training (training/speed/fused.py, training/speed/native's kernels): dense +
dropout + residual + layer norm give the values and gradients torch's own ops give within bf16's rounding, and
each block runs its own forward wherever the fused path does not apply."""
from __future__ import annotations

import pytest
from conftest import NEEDS_GCC

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from training.speed import fused, native

pytestmark = [NEEDS_GCC, pytest.mark.usefixtures("fresh_native")]


@pytest.fixture(params=[1, 3])
def threads(request):
    """The kernels split rows (and the bias gradient's partial sums) over torch's threads: one, and three."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_install_routes_bert_output_blocks_only_and_the_checkpoint_is_unchanged():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from training.speed import fastdrop

    bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=100))
    keys = list(bert.state_dict())
    assert fused.install(bert) == 0  # torch's nn.Dropout: the user asked for its masks
    fastdrop.install(bert, attention=False)
    assert fused.install(bert) == 4  # per layer: the attention's output and the FFN's
    assert list(bert.state_dict()) == keys
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=16))
    fastdrop.install(gpt2, attention=False)
    assert fused.install(gpt2) == 0


def test_a_bf16_bert_trains_the_same_with_and_without_it():
    """Two copies of a small bf16 BERT, one routed: their losses over a few optimizer steps agree to bf16's
    noise."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                     vocab_size=200, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = BertForSequenceClassification(cfg).to(torch.bfloat16).train()
    routed = BertForSequenceClassification(cfg).to(torch.bfloat16).train()
    routed.load_state_dict(base.state_dict())
    from training.speed import fastdrop

    for model in (base, routed):
        fastdrop.install(model, attention=False)  # p = 0: no draws, and the output blocks may route
    assert fused.install(routed) == 4  # per layer: the attention's output and the FFN's
    ids, labels = torch.randint(0, 200, (8, 24)), torch.randint(0, 2, (8,))
    losses = {}
    for name, model in (("base", base), ("routed", routed)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses[name] = []
        for _ in range(4):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["routed"] == pytest.approx(losses["base"], abs=2e-2)
    assert losses["routed"][-1] < losses["routed"][0]


def _output(width=96, inner=384, p=0.0, dtype=torch.bfloat16):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertOutput

    from training.speed import fastdrop

    torch.manual_seed(0)
    block = BertOutput(BertConfig(hidden_size=width, intermediate_size=inner, hidden_dropout_prob=p)).to(dtype)
    with torch.no_grad():
        block.dense.bias.normal_(0.0, 0.5)
        block.LayerNorm.weight.normal_(1.0, 0.3)
        block.LayerNorm.bias.normal_(0.0, 0.3)
    fastdrop.install(block, attention=False)
    return block


def _output_reference(block, x, res, grad, keep=None, p=0.0):
    """dense, dropout with the given mask, residual and layer norm in fp32 on the same bf16 values."""
    d, n = block.dense, block.LayerNorm
    leaves = [t.detach().float().requires_grad_() for t in (x, res, d.weight, d.bias, n.weight, n.bias)]
    x32, r32, w, b, gamma, beta = leaves
    z = torch.nn.functional.linear(x32, w, b)
    if keep is not None:
        z = z * keep / (1 - p)
    y = torch.nn.functional.layer_norm(z + r32, (z.shape[-1],), gamma, beta, n.eps)
    y.backward(grad.float())
    return y.detach(), [t.grad for t in leaves]


def _close(got, want, what, rel=2 ** -7):
    err = (got.float() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-3, f"{what}: max error {err} (largest {want.abs().max()})"


def test_the_output_block_forward_and_gradients_are_torchs_within_bf16_rounding(threads):
    block = _output()
    assert fused.install(block) == 1
    x = torch.randn(3, 37, 384).bfloat16().requires_grad_()
    res = torch.randn(3, 37, 96).bfloat16().requires_grad_()
    grad = torch.randn(3, 37, 96).bfloat16()
    y = block(x, res)
    assert type(y.grad_fn).__name__ == "_DenseDropAddNormBackward" and y.shape == res.shape
    y.backward(grad)
    ry, (gx, gres, gw, gb, ggamma, gbeta) = _output_reference(block, x, res, grad)
    _close(y, ry, "layer_norm(dense(x) + residual)")
    d, n = block.dense, block.LayerNorm
    for got, want, what in ((x.grad, gx, "input"), (res.grad, gres, "residual"), (d.weight.grad, gw, "weight"),
                            (d.bias.grad, gb, "bias"), (n.weight.grad, ggamma, "gamma"), (n.bias.grad, gbeta, "beta")):
        _close(got, want, f"{what} gradient", rel=2 ** -6)
        assert got.dtype == torch.bfloat16


def test_the_output_blocks_dropout_keeps_one_minus_p_follows_the_seed_and_its_gradient_the_mask():
    block = _output(width=256, inner=64, p=0.1)
    fused.install(block)
    x = torch.randn(40, 50, 64).bfloat16().requires_grad_()
    res = torch.zeros(40, 50, 256).bfloat16()
    torch.manual_seed(5)
    y = block(x, res)
    ctx = y.grad_fn
    keep = ctx.saved_tensors[-1].view(40, 50, 256).float()
    assert abs(keep.mean().item() - 0.9) < 3e-3  # 512k draws
    torch.manual_seed(5)
    assert torch.equal(block(x, res), y)
    grad = torch.randn_like(y)
    y.backward(grad)
    ry, (gx, _, gw, gb, _, _) = _output_reference(block, x, res, grad, keep=keep, p=0.1)
    _close(y, ry, "dropped forward")
    _close(x.grad, gx, "input gradient through the mask", rel=2 ** -6)
    _close(block.dense.bias.grad, gb, "bias gradient through the mask", rel=2 ** -6)
    _close(block.dense.weight.grad, gw, "weight gradient through the mask", rel=2 ** -6)


@pytest.mark.parametrize("case", ["eval", "fp32", "no-grad", "native-off"])
def test_where_it_does_not_apply_the_output_block_runs_its_own_forward_bit_for_bit(case, monkeypatch):
    block = _output(width=32, inner=64, p=0.1, dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    fused.install(block)
    dtype = next(block.parameters()).dtype
    x, res = torch.randn(4, 64, dtype=dtype), torch.randn(4, 32, dtype=dtype)
    if case == "eval":
        block.eval()
    if case == "native-off":
        monkeypatch.setenv(native.ENV, "0")
        native.reset()
    with torch.set_grad_enabled(case != "no-grad"):
        torch.manual_seed(3)
        y = block(x.requires_grad_(case != "no-grad"), res)
        torch.manual_seed(3)
        assert torch.equal(y, type(block).forward(block, x, res))
    assert y.grad_fn is None or type(y.grad_fn).__name__ != "_DenseDropAddNormBackward"


def test_a_bad_dropout_probability_gets_fastdrops_own_error():
    block = _output(width=32, inner=64, p=0.1)
    fused.install(block)
    x, res = torch.randn(4, 64).bfloat16(), torch.randn(4, 32).bfloat16()
    block.dropout.p = 1.0
    with pytest.raises(ValueError, match="not in"):  # fastdrop's own error, not a division by zero
        block(x, res)

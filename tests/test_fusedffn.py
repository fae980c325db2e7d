"""The encoder FFN's dense + GELU in bf16 training (training/fusedffn.py, training/native's kernels): the values
and gradients torch's own ops give, within bf16's rounding, and the module's own forward wherever it does not
apply."""
from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from training import fusedffn, native

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc: training/native's kernels are not built")


@pytest.fixture(autouse=True)
def fresh_native():
    native.reset()
    yield
    native.reset()


def _block(width=96, ffn=384, dtype=torch.bfloat16):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertIntermediate

    torch.manual_seed(0)
    block = BertIntermediate(BertConfig(hidden_size=width, intermediate_size=ffn, hidden_act="gelu")).to(dtype)
    with torch.no_grad():
        block.dense.bias.normal_(0.0, 0.5)
    return block


def _reference(block, x, grad):
    """dense + exact GELU in fp32 on the same bf16 values: what the fused path rounds to bf16 once more."""
    w = block.dense.weight.detach().float().requires_grad_()
    b = block.dense.bias.detach().float().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    y = torch.nn.functional.gelu(torch.nn.functional.linear(x32, w, b))
    y.backward(grad.float())
    return y.detach(), x32.grad, w.grad, b.grad


@pytest.fixture(params=[1, 3])
def threads(request):
    """The kernels split rows (and the bias gradient's partial sums) over torch's threads: one, and three."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_forward_and_every_gradient_are_torchs_within_bf16_rounding(threads):
    block = _block()
    assert fusedffn.install(block) == 1
    x = (torch.randn(3, 37, 96) * 2).bfloat16().requires_grad_()  # rows not a multiple of anything the kernel blocks
    grad = torch.randn(3, 37, 384).bfloat16()
    y = block(x)
    assert y.dtype == torch.bfloat16 and y.grad_fn is not None and type(y.grad_fn).__name__ == "_DenseGeluBackward"
    y.backward(grad)
    ry, rx, rw, rb = _reference(block, x, grad)

    def close(got, want, what):
        err = (got.float() - want).abs().max().item()
        assert err <= 2 ** -7 * want.abs().max().item() + 1e-4, f"{what}: max error {err}"

    close(y, ry, "gelu(dense(x))")
    close(x.grad, rx, "input gradient")
    close(block.dense.weight.grad, rw, "weight gradient")
    close(block.dense.bias.grad, rb, "bias gradient")
    assert block.dense.weight.grad.dtype == block.dense.bias.grad.dtype == torch.bfloat16


def test_the_slope_matters_a_wrong_one_fails_the_comparison():
    """The backward multiplies by the kept slope: checked against a GELU whose slope is plainly not the erf
    form's, so the comparison above is one that can fail."""
    block = _block()
    fusedffn.install(block)
    x = torch.randn(64, 96).bfloat16().requires_grad_()
    grad = torch.randn(64, 384).bfloat16()
    block(x).backward(grad)
    w = block.dense.weight.detach().float()
    h = torch.nn.functional.linear(x.detach().float(), w, block.dense.bias.detach().float())
    wrong = (grad.float() * torch.sigmoid(1.702 * h)) @ w  # x * sigmoid(1.702 x)'s first term only
    right = (grad.float() * torch.ops.aten.gelu_backward(torch.ones_like(h), h)) @ w
    assert (x.grad.float() - right).abs().max() < (x.grad.float() - wrong).abs().max() / 4


@pytest.mark.parametrize("case", ["eval", "fp32", "no-grad", "native-off"])
def test_where_it_does_not_apply_the_block_runs_its_own_forward_bit_for_bit(case, monkeypatch):
    block = _block(dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    own = type(block).forward
    fusedffn.install(block)
    x = torch.randn(5, 96, dtype=next(block.parameters()).dtype)
    if case == "eval":
        block.eval()
    if case == "native-off":
        monkeypatch.setenv(native.ENV, "0")
        native.reset()
    with torch.set_grad_enabled(case != "no-grad"):
        y = block(x.requires_grad_(case != "no-grad"))
    assert torch.equal(y, own(block, x))
    assert y.grad_fn is None or type(y.grad_fn).__name__ != "_DenseGeluBackward"


def test_install_routes_bert_blocks_only_and_the_checkpoint_is_unchanged():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=100))
    keys = list(bert.state_dict())
    assert fusedffn.install(bert) == 2
    assert list(bert.state_dict()) == keys
    tanh = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=100, hidden_act="gelu_new"))
    assert fusedffn.install(tanh) == 0  # not the erf GELU the kernel computes
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=16))
    assert fusedffn.install(gpt2) == 0


def test_a_bf16_bert_trains_the_same_with_and_without_it():
    """Two copies of a small bf16 BERT, one routed: their losses over a few optimizer steps agree to bf16's
    noise, and the routed one did go through the kernel."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                     vocab_size=200, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = BertForSequenceClassification(cfg).to(torch.bfloat16).train()
    routed = BertForSequenceClassification(cfg).to(torch.bfloat16).train()
    routed.load_state_dict(base.state_dict())
    assert fusedffn.install(routed) == 2
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

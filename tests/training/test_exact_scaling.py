"""The two causes of node-count-dependent gradients, each on its own and in one process (the 2-node proof is
tests/training/test_loss_scale.py): qa's loss must not depend on how far a batch is padded, and an evaluation before
training must not stop accelerate from wrapping the model in DDP."""
from __future__ import annotations

import torch

from training.jobs import dist, qa


def tiny_qa_model():
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForQuestionAnswering(config).eval()


def batch(pad_to: int, lengths=(12, 9)):
    """Two windows of 12 and 9 real tokens, padded to pad_to (as a per-batch collator would)."""
    ids = torch.zeros(2, pad_to, dtype=torch.long)
    mask = torch.zeros(2, pad_to, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 7 * i
        mask[i, :n] = 1
    return ids, mask, torch.tensor([3, 2]), torch.tensor([5, 4])


def losses_and_grad(model, pad_to: int, masked: bool, lengths=(12, 9)):
    model.zero_grad()
    ids, mask, starts, ends = batch(pad_to, lengths)
    if masked:
        out = model(input_ids=ids, attention_mask=mask)
        loss = qa.masked_span_loss(out.start_logits, out.end_logits, mask, starts, ends)
    else:  # transformers' own head: pad positions stay in the softmax
        loss = model(input_ids=ids, attention_mask=mask, start_positions=starts, end_positions=ends).loss
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


def test_the_span_loss_does_not_depend_on_padding_where_the_heads_own_does():
    model = tiny_qa_model()
    short, long_ = losses_and_grad(model, 12, masked=True), losses_and_grad(model, 40, masked=True)
    assert abs(short[0] - long_[0]) <= 1e-5 * short[0]
    assert abs(short[1] - long_[1]) <= 1e-4 * short[1]
    upstream_short, upstream_long = losses_and_grad(model, 12, masked=False), losses_and_grad(model, 40, masked=False)
    assert abs(upstream_short[0] - upstream_long[0]) > 1e-3 * upstream_short[0]  # what the fix is for
    unpadded = losses_and_grad(model, 12, masked=True, lengths=(12, 12))
    upstream_unpadded = losses_and_grad(model, 12, masked=False, lengths=(12, 12))
    assert abs(upstream_unpadded[0] - unpadded[0]) <= 1e-5 * unpadded[0]  # without padding: the same loss


def test_an_evaluation_before_training_leaves_the_model_free_for_ddp(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_qa_model()
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "attention_mask": [[1, 1, 1, 1]] * 4,
                            "start_positions": [1] * 4, "end_positions": [2] * 4})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_eval_batch_size=2)
    trainer = Trainer(model=model, args=args, eval_dataset=ds)
    assert dist.ready_for_ddp(trainer) is False  # nothing evaluated yet: nothing to undo
    trainer.evaluate()
    assert getattr(trainer.model, "_is_accelerate_prepared", False), "accelerate no longer marks it: re-check the cause"
    assert dist.ready_for_ddp(trainer) is True
    assert not trainer.model._is_accelerate_prepared

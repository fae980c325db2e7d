"""The manual recipe's model shapes for the bench, built from a config with random weights (no download).

    minilm      the offline MiniLM-L6 the jobs default to (real weights; accuracy is measured on it)
    bert-base   bert-base-cased's shape: 12 layers, width 768, 12 heads, FFN 3072, 512 positions
    gpt2        GPT-2 small: 12 layers, width 768, 12 heads, FFN 3072, 1024 positions, vocabulary 50257

bert-base keeps the bundled tokenizer (MiniLM's, 30522 ids): bert-base-cased's 28996-row embedding cannot
hold its ids. Only the word-embedding rows differ; they are frozen by default and outside the FLOP count,
which is 6 x the non-embedding matmul parameters per token (forward 2, backward 4) plus attention's score
and value products, 12 x layers x width x tokens; for gpt2 the tied output projection (width x vocabulary)
is a matmul of every token and counts too. The MFU peak is torch's matmul at the model's own FFN shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHAPES = ("minilm", "bert-base", "gpt2")
GPT2_BLOCK = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    width: int
    heads: int
    ffn: int
    vocab: int
    head_vocab: int = 0  # an output projection over the vocabulary (a causal LM head), 0 for classifiers

    def flops_per_token(self, tokens: float) -> float:
        params = self.layers * (4 * self.width ** 2 + 2 * self.width * self.ffn) + self.width * self.head_vocab
        return 6 * params + 12 * self.layers * self.width * tokens


BERT_BASE = Shape("bert-base", 12, 768, 12, 3072, 28996)
GPT2 = Shape("gpt2", 12, 768, 12, 3072, 50257, head_vocab=50257)


def minilm() -> Shape:
    from transformers import AutoConfig

    from training.jobs.common import DEFAULT_MODEL, resolve_model

    c = AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL))
    return Shape("minilm", c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size,
                 c.vocab_size)


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"model shape {name!r} is not one of {', '.join(SHAPES)}")
    return {"minilm": minilm, "bert-base": lambda: BERT_BASE, "gpt2": lambda: GPT2}[name]()


def gpt2_overrides() -> str:
    """clm's --config_overrides for GPT-2 small from scratch (its vocabulary, not the learned tokenizer's)."""
    return f"n_layer={GPT2.layers},n_head={GPT2.heads},n_embd={GPT2.width},vocab_size={GPT2.vocab}"


def write_bert_base(dest: Path, num_labels: int = 2) -> Path:
    """A bert-base-shaped classifier with random weights and the bundled tokenizer, saved where the glue job's
    --model_name_or_path can load it."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from training.jobs.common import DEFAULT_MODEL, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    s = BERT_BASE
    config = BertConfig(vocab_size=max(s.vocab, len(tokenizer)), hidden_size=s.width, num_hidden_layers=s.layers,
                        num_attention_heads=s.heads, intermediate_size=s.ffn, max_position_embeddings=512,
                        num_labels=num_labels)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / "shape.json").write_text(json.dumps({"shape": s.name, "random_weights": True}))
    return dest

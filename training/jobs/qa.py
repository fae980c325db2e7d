"""Bundled run_qa: extractive question answering (SQuAD) with Trainer, across MPI ranks.

Flags are run_qa's: --dataset_name squad (hub) or --train_file / --validation_file in SQuAD
JSON (the original nested v1.1 layout or flat records), --max_seq_length, --doc_stride,
--n_best_size, --max_answer_length, --version_2_with_negative, plus TrainingArguments.
Contexts longer than max_seq_length are split into overlapping windows (doc_stride tokens of
overlap) with character offsets, so predictions map back to text in the context. Exact match
and F1 are SQuAD's, computed locally. Without data flags it trains on the bundled
encyclopedia set (training/jobs/data/squad) with MiniLM and a fresh QA head.
"""
from __future__ import annotations

import collections
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from training.jobs import common, dist
from training.runtime import preempt
from training.speed import levers

log = logging.getLogger("training.jobs.qa")

BUNDLED = Path(__file__).resolve().parent / "data" / "squad"


@dataclass
class ModelArguments(levers.SpeedArguments):
    model_name_or_path: str = field(default=common.DEFAULT_MODEL, metadata={"help": "Hub id or local path"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub downloads are cached"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub data set, e.g. squad or squad_v2"})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={"help": "SQuAD JSON training data"})
    validation_file: str | None = field(default=None, metadata={"help": "SQuAD JSON validation data"})
    max_seq_length: int = field(default=384, metadata={"help": "Tokens per window: question + context part"})
    doc_stride: int = field(default=128, metadata={"help": "Tokens of overlap between windows of a long context"})
    pad_to_max_length: bool = field(default=False, metadata={
        "help": "Pad every window to max_seq_length (run_qa's default) instead of per batch"})
    pad_to_multiple_of: int = field(default=1, metadata={"help": "Per-batch padding rounds lengths up to this (1 = exact)"})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use the first N training examples"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use the first N validation examples"})
    n_best_size: int = field(default=20, metadata={"help": "Start/end candidates per window when decoding"})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer in tokens"})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Some questions have no answer (v2)"})
    null_score_diff_threshold: float = field(default=0.0, metadata={
        "help": "v2: answer nothing when the null score beats the best span by more than this"})
    preprocessing_num_workers: int | None = field(default=None)

    def __post_init__(self):
        if self.dataset_name is None and self.train_file is None and self.validation_file is None:
            self.train_file = str(BUNDLED / "train.json")
            self.validation_file = str(BUNDLED / "validation.json")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name} {path} does not exist; pass an existing SQuAD JSON file")
        if self.doc_stride >= self.max_seq_length - 16:
            raise ValueError(f"--doc_stride {self.doc_stride} must be well below --max_seq_length "
                             f"{self.max_seq_length} (the overlap has to leave room for new context); lower it")


def read_squad_json(path: str) -> list[dict]:
    """Flat records (id, title, context, question, answers{text, answer_start}) from a SQuAD file:
    the original nested layout (data/paragraphs/qas) or the flat one the hub and run_qa use."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); pass a SQuAD JSON file") from None
    entries = raw.get("data", raw) if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path} has no 'data' list; expected SQuAD JSON ({{'data': [...]}})")
    records = []
    for article in entries:
        if "paragraphs" in article:
            for para in article["paragraphs"]:
                for qa in para.get("qas", []):
                    golds = qa.get("answers", [])
                    records.append({"id": str(qa["id"]), "title": article.get("title", ""),
                                    "context": para["context"], "question": qa["question"],
                                    "answers": {"text": [a["text"] for a in golds],
                                                "answer_start": [int(a["answer_start"]) for a in golds]}})
        elif {"context", "question", "answers"} <= set(article):
            records.append({"id": str(article.get("id", len(records))), "title": article.get("title", ""),
                            "context": article["context"], "question": article["question"],
                            "answers": {"text": list(article["answers"]["text"]),
                                        "answer_start": [int(s) for s in article["answers"]["answer_start"]]}})
        else:
            raise ValueError(f"{path}: an entry has neither 'paragraphs' nor context/question/answers; "
                             "expected SQuAD JSON")
    return records


def load_raw(data: DataArguments, model: ModelArguments):
    from datasets import Dataset, DatasetDict, load_dataset

    if data.dataset_name:
        return load_dataset(data.dataset_name, data.dataset_config_name, cache_dir=model.cache_dir)
    splits = {}
    for split, path in (("train", data.train_file), ("validation", data.validation_file)):
        if path:
            splits[split] = Dataset.from_list(read_squad_json(path))
    return DatasetDict(splits)


def _windows(tokenizer, examples, data: DataArguments, max_len: int, padding):
    """(question, context) tokenized into overlapping windows of the context, with offsets."""
    questions = [q.lstrip() for q in examples["question"]]
    pad_on_right = tokenizer.padding_side == "right"
    return tokenizer(questions if pad_on_right else examples["context"],
                     examples["context"] if pad_on_right else questions,
                     truncation="only_second" if pad_on_right else "only_first", max_length=max_len,
                     stride=data.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                     padding=padding)


def train_features(tokenizer, data: DataArguments, max_len: int, padding):
    """Windows of (question, context) with the answer's token span; a window without the answer
    points at the CLS token (SQuAD v2's 'no answer')."""
    pad_on_right = tokenizer.padding_side == "right"

    def prepare(examples):
        enc = _windows(tokenizer, examples, data, max_len, padding)
        sample_map = enc.pop("overflow_to_sample_mapping")
        offsets_all = enc.pop("offset_mapping")
        enc["start_positions"], enc["end_positions"], enc["length"] = [], [], []
        context_id = 1 if pad_on_right else 0
        for i, offsets in enumerate(offsets_all):
            ids = enc["input_ids"][i]
            cls = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
            seq = enc.sequence_ids(i)
            answers = examples["answers"][sample_map[i]]
            enc["length"].append(sum(enc["attention_mask"][i]))
            if not answers["answer_start"]:
                enc["start_positions"].append(cls)
                enc["end_positions"].append(cls)
                continue
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            first = seq.index(context_id)
            last = len(seq) - 1 - seq[::-1].index(context_id)
            if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
                enc["start_positions"].append(cls)  # the answer is outside this window
                enc["end_positions"].append(cls)
                continue
            while first <= last and offsets[first][0] <= start_char:
                first += 1
            enc["start_positions"].append(first - 1)
            while last >= 0 and offsets[last][1] >= end_char:
                last -= 1
            enc["end_positions"].append(last + 1)
        return enc

    return prepare


def eval_features(tokenizer, data: DataArguments, max_len: int, padding):
    """Windows like train_features, keeping each window's example id and the character offsets of
    its context tokens (None elsewhere) to map predicted spans back to text."""
    pad_on_right = tokenizer.padding_side == "right"

    def prepare(examples):
        enc = _windows(tokenizer, examples, data, max_len, padding)
        sample_map = enc.pop("overflow_to_sample_mapping")
        context_id = 1 if pad_on_right else 0
        enc["example_id"] = []
        for i in range(len(enc["input_ids"])):
            seq = enc.sequence_ids(i)
            enc["example_id"].append(examples["id"][sample_map[i]])
            enc["offset_mapping"][i] = [o if seq[k] == context_id else None
                                        for k, o in enumerate(enc["offset_mapping"][i])]
        return enc

    return prepare


def postprocess(examples, features, start_logits, end_logits, data: DataArguments) -> dict[str, str]:
    """Best span per example over all its windows: top n_best starts x ends, inside the context,
    end >= start, at most max_answer_length tokens; score = start + end logit (run_qa's rule)."""
    by_example = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        by_example[ex_id].append(i)
    offsets_all = features["offset_mapping"]
    predictions = {}
    for ex in examples:
        best_text, best_score, null_score = "", None, None
        for fi in by_example.get(ex["id"], []):
            starts, ends, offsets = start_logits[fi], end_logits[fi], offsets_all[fi]
            cls_score = float(starts[0] + ends[0])
            null_score = cls_score if null_score is None else min(null_score, cls_score)
            top_s = np.argsort(starts)[-1:-data.n_best_size - 1:-1]
            top_e = np.argsort(ends)[-1:-data.n_best_size - 1:-1]
            for s in top_s:
                for e in top_e:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > data.max_answer_length:
                        continue
                    score = float(starts[s] + ends[e])
                    if best_score is None or score > best_score:
                        best_score = score
                        best_text = ex["context"][offsets[s][0]:offsets[e][1]]
        if data.version_2_with_negative and null_score is not None and (
                best_score is None or null_score - best_score > data.null_score_diff_threshold):
            best_text = ""
        predictions[ex["id"]] = best_text
    return predictions


def masked_span_loss(start_logits, end_logits, attention_mask, start_positions, end_positions):
    """The QA head's loss, (CE(start) + CE(end)) / 2 over the batch, with padding tokens out of the softmax.
    transformers' heads (BertForQuestionAnswering.forward, loss/loss_utils.py ForQuestionAnsweringLoss)
    leave pad positions in it, so the loss depends on how far a batch is padded: on 2 nodes each rank pads
    its half to its own longest window and the loss and gradients differed from one process's (1.5% and
    2.6%) on the same samples."""
    import torch

    pad = attention_mask == 0
    ignored = start_logits.size(1)  # as upstream: a position past the window is ignored
    losses = []
    for logits, positions in ((start_logits, start_positions), (end_logits, end_positions)):
        logits = logits.float().masked_fill(pad, torch.finfo(torch.float32).min)
        positions = positions.view(-1).clamp(0, ignored)
        losses.append(torch.nn.functional.cross_entropy(logits, positions, ignore_index=ignored))
    return (losses[0] + losses[1]) / 2


def span_trainer(trainer_cls):
    """trainer_cls whose training loss is masked_span_loss (mean per rank, as mean_loss_per_rank expects)."""

    class SpanTrainer(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if "start_positions" not in inputs or "attention_mask" not in inputs:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs = dict(inputs)
            starts, ends = inputs.pop("start_positions"), inputs.pop("end_positions")
            outputs = model(**inputs)
            loss = masked_span_loss(outputs.start_logits, outputs.end_logits, inputs["attention_mask"], starts, ends)
            return (loss, outputs) if return_outputs else loss

    return SpanTrainer


def first_tokens_baseline(examples, words: int) -> dict[str, str]:
    """The trivial baseline: the context's first `words` words, whatever the question."""
    return {ex["id"]: " ".join(ex["context"].split()[:words]) for ex in examples}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    info = dist.setup()
    common.setup_logging(info.is_main)
    started = time.monotonic()

    from transformers import (
        AutoConfig,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        DataCollatorWithPadding,
        PreTrainedTokenizerFast,
        Trainer,
        default_data_collator,
    )

    argv = common.job_argv(argv, info.precision)
    model_args, data_args, args = common.parse_job_args(argv, ModelArguments, DataArguments)
    levers.check(model_args, args, argv)  # bad flags: before loading anything
    from training.speed import speedup  # lazy: torch (~1000 modules), which the job's module does not import

    raw = load_raw(data_args, model_args)
    if args.do_train and "train" not in raw:
        raise ValueError("--do_train needs training data; pass --train_file or --dataset_name")
    if args.do_eval and "validation" not in raw:
        raise ValueError("--do_eval needs validation data; pass --validation_file or --dataset_name")

    model_path = common.resolve_model(model_args.model_name_or_path)
    config = AutoConfig.from_pretrained(model_path, cache_dir=model_args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=True, cache_dir=model_args.cache_dir)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{model_args.model_name_or_path} has no fast tokenizer; run_qa needs its offset mapping")  # noqa: TRY004
    model = common.mean_loss_per_rank(
        AutoModelForQuestionAnswering.from_pretrained(model_path, config=config, cache_dir=model_args.cache_dir))
    fast = speedup.apply(model, model_args, args, argv, Trainer, lambda m: common.ipex_optimizers(m, args, info))
    model = fast.model
    max_len = min(data_args.max_seq_length, tokenizer.model_max_length)
    padding = "max_length" if data_args.pad_to_max_length else False

    train_ds = eval_examples = eval_ds = None
    if args.do_train:
        train_examples = common.take(raw["train"], data_args.max_train_samples)
        with args.main_process_first(desc="train windows"):
            features = train_features(tokenizer, data_args, max_len, padding)
            train_ds = train_examples.map(features, batched=True, new_fingerprint=common.map_fingerprint(
                train_examples, features, tokenizer, repr(data_args), max_len, padding),
                remove_columns=train_examples.column_names, desc="train windows", num_proc=data_args.preprocessing_num_workers)
    if args.do_eval:
        eval_examples = common.take(raw["validation"], data_args.max_eval_samples)
        with args.main_process_first(desc="eval windows"):
            features = eval_features(tokenizer, data_args, max_len, padding)
            eval_ds = eval_examples.map(features, batched=True, new_fingerprint=common.map_fingerprint(
                eval_examples, features, tokenizer, repr(data_args), max_len, padding),
                remove_columns=eval_examples.column_names, desc="eval windows", num_proc=data_args.preprocessing_num_workers)

    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=data_args.pad_to_multiple_of if data_args.pad_to_multiple_of > 1 else None)
    trainer = span_trainer(Trainer)(model=model, args=args, train_dataset=train_ds, processing_class=tokenizer,
                                    data_collator=collator, optimizers=fast.optimizers,
                                    callbacks=[preempt.progress_callback()])
    common.quiet_trainer(trainer)
    fast.attach(trainer)
    hook = dist.comm_hook(trainer)
    results = common.run_header(
        "qa", info, args, model_args.model_name_or_path, dataset=data_args.dataset_name,
        train_file=data_args.train_file, validation_file=data_args.validation_file,
        data_fingerprint=common.fingerprint(data_args.train_file, data_args.validation_file),
        max_seq_length=max_len, doc_stride=data_args.doc_stride,
        padding="max_length" if data_args.pad_to_max_length else f"batch/{data_args.pad_to_multiple_of}",
        group_by_length=common.length_grouping(args), comm_hook=hook, speed=fast.applied,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad))
    if train_ds is not None:
        results["train_examples"] = len(train_examples)
    common.train_and_record(trainer, results, train_ds, info)
    fast.finish()

    line = None
    if eval_ds is not None:
        eval_start = time.monotonic()
        # Windows without their bookkeeping columns go to the model; the columns map logits back to text,
        # by position: length grouping would reorder the eval batches too (Trainer applies it to both).
        common.set_length_grouping(trainer.args, False)
        model_ds = eval_ds.remove_columns(["example_id", "offset_mapping"])
        out = trainer.predict(model_ds, metric_key_prefix="eval")
        start_logits, end_logits = out.predictions[:2] if isinstance(out.predictions, tuple) else out.predictions
        predictions = postprocess(eval_examples, eval_ds, start_logits, end_logits, data_args)
        golds = {ex["id"]: list(ex["answers"]["text"]) for ex in eval_examples}
        ref = raw.get("train", eval_examples)
        lengths = [len(t.split()) for a in ref.select(range(min(len(ref), 2000)))["answers"] for t in a["text"]]
        baseline_words = max(1, round(float(np.median(lengths)))) if lengths else 3
        scores = common.squad_scores(predictions, golds)
        base = common.squad_scores(first_tokens_baseline(eval_examples, baseline_words), golds)
        results["eval"] = {"eval_exact_match": scores["exact_match"], "eval_f1": scores["f1"],
                           "eval_baseline_exact_match": base["exact_match"], "eval_baseline_f1": base["f1"],
                           "eval_baseline": f"first {baseline_words} word(s) of the context",
                           "eval_runtime": time.monotonic() - eval_start,
                           "samples": len(eval_examples), "windows": len(eval_ds)}
        if info.is_main:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.output_dir) / "eval_predictions.json").write_text(json.dumps(predictions, indent=1))
        tr = results.get("train", {})
        line = (f"eval exact match {scores['exact_match']:.2f} f1 {scores['f1']:.2f} "
                f"(first-{baseline_words}-words baseline f1 {base['f1']:.2f}) "
                f"train {tr.get('train_samples_per_second', float('nan')):.1f} windows/s in {tr.get('wall_s', 0):.1f}s")
    common.finish(info, args, results, started, line, trainer)
    return 0


if __name__ == "__main__":
    common.cli(main)

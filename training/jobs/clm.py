"""Bundled GPT-2 fine-tuning (causal language modelling), the seeds' nanoGPT recipe on Trainer.

Two steps, as in nanoGPT's prepare.py + train.py:
1. prepare: the corpus is tokenized once into flat token files (train.bin, validation.bin:
   np.memmap uint16, the document separator between documents) plus meta.json and the
   tokenizer. Rank 0 prepares into a cache keyed by the corpus and tokenizer; a node whose
   cache lacks the folder receives rank 0's copy through the process group, so every node
   trains on identical tokens and later runs reuse them. --prepare_only stops there.
2. train: DDP over fixed blocks of --block_size tokens read from the memory-mapped files,
   eval loss and perplexity every --eval_steps (and at step 0), a final checkpoint in
   <output_dir>/final.

--model_name_or_path gpt2 fine-tunes GPT-2 small from the hub (its tokenizer; blocks of 1024).
Without it a tiny GPT-2 (--config_overrides, default 2 layers x 128) is trained from scratch
with a byte-level BPE tokenizer learned on the corpus: the offline path, on the bundled
encyclopedia corpus (training/jobs/data/corpus) unless data flags say otherwise.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from training.jobs import common, dist
from training.jobs.clm_data import TINY, DataArguments, ModelArguments, TokenBlocks, prepared_folder
from training.runtime import events, preempt
from training.speed import levers

log = logging.getLogger("training.jobs.clm")


# ---- step 1: prepare -------------------------------------------------------------------------


# ---- step 2: train ---------------------------------------------------------------------------


def eval_callback(history: list):
    """Records eval loss / perplexity and prints them on rank 0 as they come."""
    from transformers import TrainerCallback

    class EvalLog(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kw):
            if not metrics or "eval_loss" not in metrics:
                return
            loss = float(metrics["eval_loss"])
            history.append({"step": state.global_step, "eval_loss": loss, "perplexity": perplexity(loss)})
            if state.is_world_process_zero:
                events.emit(events.RunEvent(events.EVAL, 0, state.global_step,
                                            payload={"loss": loss, "perplexity": perplexity(loss)}))

    return EvalLog()


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    info = dist.setup()
    common.setup_logging(info.is_main)
    started = time.monotonic()

    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GPT2Config,
        Trainer,
        default_data_collator,
    )

    argv = common.job_argv(argv, info.precision)
    # A tiny model from scratch wants a far larger step than fine-tuning a pretrained one.
    lr = 5e-5 if common.has_flag(argv, "--model_name_or_path") else 1e-3
    model_args, data_args, args = common.parse_job_args(argv, ModelArguments, DataArguments,
                                                        group_by_length=False, eval_strategy="steps",
                                                        learning_rate=lr)
    levers.block_attention(model_args.block_attention)  # a bad value stops here, before any data is prepared

    folder = prepared_folder(data_args, model_args, info)
    meta = json.loads((folder / "meta.json").read_text())
    if data_args.prepare_only:
        if info.is_main:
            print(f"[result] prepared {meta['tokens']} tokens in {folder}", flush=True)
        common.finish(info, args, {"job": "clm", "prepared": str(folder), "meta": meta}, started)
        return 0
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")

    if model_args.model_name_or_path:
        model_path = common.resolve_model(model_args.model_name_or_path)
        config = AutoConfig.from_pretrained(model_path, cache_dir=model_args.cache_dir)
        levers.causal_lm_config(config, model_args)
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, cache_dir=model_args.cache_dir,
                                                     attn_implementation=model_args.attn_implementation)
        if model.get_input_embeddings().num_embeddings < meta["vocab_size"]:
            model.resize_token_embeddings(meta["vocab_size"])
        block_size = data_args.block_size or min(1024, getattr(model.config, "n_positions", 1024))
    else:
        block_size = data_args.block_size or 128
        config = GPT2Config(vocab_size=meta["vocab_size"], n_positions=max(block_size, 128),
                            bos_token_id=meta["eos_token_id"], eos_token_id=meta["eos_token_id"])
        config.update_from_string(model_args.config_overrides or TINY)
        levers.causal_lm_config(config, model_args)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=model_args.attn_implementation)
    if block_size > getattr(model.config, "n_positions", block_size):
        raise ValueError(f"--block_size {block_size} is longer than the model's {model.config.n_positions} "
                         "positions; lower it")
    train_ds = TokenBlocks(folder / "train.bin", block_size, data_args.max_train_samples) if args.do_train else None
    eval_ds = TokenBlocks(folder / "validation.bin", block_size, data_args.max_eval_samples) if args.do_eval else None
    for name, ds in (("train", train_ds), ("validation", eval_ds)):
        if ds is not None and len(ds) == 0:
            raise ValueError(f"the {name} tokens do not fill one block of {block_size}; lower --block_size "
                             "or add text")
    if not args.do_eval:
        args.eval_strategy = "no"
    elif train_ds is not None and not common.has_flag(argv, "--eval_steps"):
        per_step = args.per_device_train_batch_size * info.world_size * args.gradient_accumulation_steps
        steps = args.max_steps if args.max_steps > 0 else \
            math.ceil(args.num_train_epochs * math.ceil(len(train_ds) / per_step))
        args.eval_steps = max(1, steps // 4)  # four evaluations along the way, plus step 0 and the end

    from training.speed import speedup  # lazy: torch (~1000 modules), which the job's module does not import

    fast = speedup.apply(model, model_args, args, argv, Trainer, lambda m: common.ipex_optimizers(m, args, info))
    model = fast.model
    history: list[dict] = []
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      processing_class=tokenizer, data_collator=default_data_collator, optimizers=fast.optimizers,
                      callbacks=[preempt.progress_callback(), eval_callback(history)])
    common.quiet_trainer(trainer)
    hook = dist.comm_hook(trainer)
    n_params = sum(p.numel() for p in model.parameters())
    results = common.run_header(
        "clm", info, args, model_args.model_name_or_path or f"gpt2-tiny({model_args.config_overrides or TINY})",
        dataset=data_args.dataset_name, train_file=data_args.train_file, validation_file=data_args.validation_file,
        data_fingerprint=folder.name, tokens=meta["tokens"], vocab_size=meta["vocab_size"],
        tokenizer=meta["tokenizer"], block_size=block_size, parameters=n_params, prepared=str(folder), comm_hook=hook,
        speed=fast.applied)
    if eval_ds is not None:
        trainer.evaluate()  # step 0: the loss to beat
    common.train_and_record(trainer, results, train_ds, info)
    if "train" in results:
        results["train"]["tokens_per_second"] = results["train"]["train_samples_per_second"] * block_size
    line = None
    if eval_ds is not None:
        metrics = {}
        if train_ds is not None and history[-1]["step"] != trainer.state.global_step:
            metrics = trainer.evaluate()  # the final model, unless the last periodic eval was at the end
        final = history[-1]
        results["eval"] = dict(metrics, eval_loss=final["eval_loss"], eval_perplexity=final["perplexity"],
                               eval_loss_step0=history[0]["eval_loss"], eval_perplexity_step0=history[0]["perplexity"],
                               history=history, samples=len(eval_ds))
        line = (f"eval loss {final['eval_loss']:.4f} perplexity {final['perplexity']:.2f} "
                f"(step 0: loss {history[0]['eval_loss']:.4f} perplexity {history[0]['perplexity']:.2f})")
    if train_ds is not None:
        final_dir = Path(args.output_dir) / "final"
        if info.is_main:
            trainer.save_model(str(final_dir))
        results["checkpoint"] = str(final_dir)
        tr = results["train"]
        line = (line + " " if line else "") + (f"train {tr['train_samples_per_second']:.1f} samples/s "
                                               f"({tr['tokens_per_second']:.0f} tokens/s) in {tr['wall_s']:.1f}s")
    common.finish(info, args, results, started, line, trainer)
    return 0


if __name__ == "__main__":
    common.cli(main)

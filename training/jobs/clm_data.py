"""clm step 1, prepare and share: the corpus tokenized once into flat token files in a cache keyed by
corpus and tokenizer, rank 0's copy sent to nodes that lack it, and fixed blocks read from them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from training.jobs import common

log = logging.getLogger("training.jobs.clm")


BUNDLED = Path(__file__).resolve().parent / "data" / "corpus"


EOS = "<|endoftext|>"


FORMAT = 1  # of a prepared folder; part of the cache key


TINY = "n_layer=2,n_head=4,n_embd=128"


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local path to fine-tune (gpt2); none trains a tiny GPT-2 from scratch"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Tokenizer (default: the model's; from scratch: a byte-level BPE learned on the corpus)"})
    config_overrides: str | None = field(default=None, metadata={
        "help": f"From scratch: GPT-2 config changes, e.g. '{TINY}' (the default)"})
    tokenizer_vocab_size: int = field(default=4096, metadata={"help": "From scratch: BPE vocabulary size"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub downloads are cached"})
    # The speed levers of training/speed/levers.py (bench/glue_single_node.py --model-shape gpt2 --levers measures them)
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa (default) | eager"})
    attention_dropout: float | None = field(default=0.0, metadata={
        "help": "Dropout on attention probabilities (default 0.0, nanoGPT's: torch's fused CPU attention "
                "runs only without it); none keeps the model's config (GPT-2: 0.1)"})
    chunked_loss: bool = field(default=True, metadata={
        "help": "LM head and cross-entropy in row chunks, no full fp32 logits (training/speed/lmloss.py)"})
    fast_dropout: bool = field(default=True, metadata={"help": "training/speed/fastdrop.py's dropout; False: torch's"})
    block_attention: str = field(default="auto", metadata={
        "help": "Causal self-attention in query blocks as matmuls (training/speed/blockattn.py) instead of torch's flash "
                "kernel, keeping ~T^2/2 probabilities a head for the backward pass: auto (where the CPU has no "
                "AMX: 1.8x flash's speed measured there; with AMX flash stays, 12% faster there), True, False"})
    fused_gelu: bool = field(default=True, metadata={
        "help": "GPT-2's tanh GELU as torch's one kernel (gelu_pytorch_tanh) instead of six element-wise ops"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub data set, e.g. Skylion007/openwebtext"})
    dataset_config_name: str | None = field(default=None)
    text_column: str = field(default="text")
    train_file: str | None = field(default=None, metadata={
        "help": "Text corpus: .txt (documents separated by blank lines) or .json/.jsonl with a text field"})
    validation_file: str | None = field(default=None)
    validation_split_percentage: float = field(default=5.0, metadata={
        "help": "Share of the training documents held out when there is no validation data"})
    block_size: int | None = field(default=None, metadata={
        "help": "Tokens per training sequence (default: 1024 for a pretrained model, 128 from scratch)"})
    data_dir: str | None = field(default=None, metadata={"help": "An already prepared folder (meta.json, *.bin)"})
    data_cache_dir: str | None = field(default=None, metadata={
        "help": "Where prepared folders are kept (default $XC_HOME/cache/clm, i.e. ~/.xeon-cluster/cache/clm)"})
    prepare_only: bool = field(default=False, metadata={"help": "Prepare the token files, print their folder, stop"})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use the first N training blocks"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use the first N validation blocks"})
    preprocessing_num_workers: int | None = field(default=None)

    def __post_init__(self):
        if self.dataset_name is None and self.train_file is None and self.data_dir is None:
            self.train_file = str(BUNDLED / "train.txt")
            if self.validation_file is None:
                self.validation_file = str(BUNDLED / "validation.txt")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name} {path} does not exist; pass an existing text file")
            if path is not None and Path(path).suffix not in (".txt", ".json", ".jsonl"):
                raise ValueError(f"--{name} {path} must be a .txt, .json or .jsonl file")
        if not 0 < self.validation_split_percentage < 50:
            raise ValueError(f"--validation_split_percentage {self.validation_split_percentage} must be in (0, 50)")


def cache_root(data: DataArguments) -> Path:
    if data.data_cache_dir:
        return Path(data.data_cache_dir)
    home = os.environ.get("XC_HOME") or str(Path.home() / ".xeon-cluster")
    return Path(home) / "cache" / "clm"


def tokenizer_source(model: ModelArguments) -> str | None:
    return model.tokenizer_name or model.model_name_or_path


def cache_key(data: DataArguments, model: ModelArguments) -> str:
    """Same corpus (by content) + same tokenizer recipe -> same folder, on every node and run."""
    spec = {
        "format": FORMAT,
        "files": common.fingerprint(data.train_file, data.validation_file) if data.train_file else None,
        "has_validation_file": data.validation_file is not None,
        "dataset": [data.dataset_name, data.dataset_config_name] if data.dataset_name else None,
        "text_column": data.text_column,
        "validation_split_percentage": data.validation_split_percentage,
        "tokenizer": tokenizer_source(model) or f"bytelevel-bpe-{model.tokenizer_vocab_size}",
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def read_documents(path: str, text_column: str) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".txt"):
        docs = [d.strip() for d in text.split("\n\n")]
    else:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl") \
                else json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if isinstance(rows, dict):
            rows = rows.get("data", [])
        if not rows or not isinstance(rows[0], dict) or text_column not in rows[0]:
            raise ValueError(f"{path} has no '{text_column}' field; set --text_column or pass a .txt corpus")
        docs = [str(r[text_column]).strip() for r in rows]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"{path} holds no text; pass a corpus with at least one document")
    return docs


def load_documents(data: DataArguments, model: ModelArguments):
    from datasets import Dataset, DatasetDict, load_dataset

    if data.dataset_name:
        raw = load_dataset(data.dataset_name, data.dataset_config_name, cache_dir=model.cache_dir)
        if data.text_column not in raw["train"].column_names:
            raise ValueError(f"--dataset_name {data.dataset_name} has no column {data.text_column!r}; set --text_column")
        raw = DatasetDict({k: v.select_columns([data.text_column]).rename_column(data.text_column, "text")
                           for k, v in raw.items() if k in ("train", "validation")})
    else:
        raw = DatasetDict({"train": Dataset.from_dict({"text": read_documents(data.train_file, data.text_column)})})
        if data.validation_file:
            raw["validation"] = Dataset.from_dict({"text": read_documents(data.validation_file, data.text_column)})
    if "validation" not in raw:
        if len(raw["train"]) < 2:
            raise ValueError("the corpus has one document; pass --validation_file or more documents")
        split = raw["train"].train_test_split(test_size=data.validation_split_percentage / 100, seed=0)
        raw = DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


def train_tokenizer(docs, vocab_size: int):
    """A GPT-2 style byte-level BPE learned on the corpus (the offline stand-in for gpt2's)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS)


def prepare(data: DataArguments, model: ModelArguments, dest: Path) -> Path:
    """Tokenize the corpus into dest/{train,validation}.bin (uint16) + meta.json + tokenizer/."""
    from transformers import AutoTokenizer

    raw = load_documents(data, model)
    tmp = dest.parent / f".{dest.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = tokenizer_source(model)
    if source:
        tokenizer = AutoTokenizer.from_pretrained(common.resolve_model(source), cache_dir=model.cache_dir)
    else:
        tokenizer = train_tokenizer(raw["train"]["text"], model.tokenizer_vocab_size)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {source} has no end-of-text token to separate documents; pick another")
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer {source} has {len(tokenizer)} tokens; the uint16 token files hold at most 65536")
    tokenizer.save_pretrained(tmp / "tokenizer")
    eos = tokenizer.eos_token_id

    def encode(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids], "len": [len(x) + 1 for x in ids]}

    tokens = {}
    for split, ds in raw.items():
        enc = ds.map(encode, batched=True, remove_columns=ds.column_names, desc=f"tokenizing {split}",
                     new_fingerprint=common.map_fingerprint(ds, encode, tokenizer, eos),
                     num_proc=data.preprocessing_num_workers)
        total = int(np.sum(enc["len"], dtype=np.int64))
        arr = np.memmap(tmp / f"{split}.bin", dtype=np.uint16, mode="w+", shape=(total,))
        pos = 0
        for start in range(0, len(enc), 1024):  # shards: the corpus never has to fit in memory twice
            chunk = np.concatenate([np.asarray(x, dtype=np.uint16) for x in enc[start:start + 1024]["ids"]])
            arr[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        arr.flush()
        del arr
        tokens[split] = total
    meta = {"format": FORMAT, "dtype": "uint16", "vocab_size": len(tokenizer), "eos_token_id": eos,
            "tokens": tokens, "documents": {k: len(v) for k, v in raw.items()},
            "tokenizer": source or f"byte-level BPE learned on the corpus ({len(tokenizer)} tokens)",
            "source": data.dataset_name or data.train_file}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    return publish(tmp, dest)


def publish(tmp: Path, dest: Path) -> Path:
    """Atomic rename into the cache; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "meta.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def folder_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def share_from_rank0(folder: Path | None, dest: Path, info, shared: bool = False) -> Path:
    """Give every node rank 0's prepared folder. Nodes that already hold it (a cache hit, or rank 0's
    --data_dir when `shared`) keep theirs; the others receive it in chunks through the process group."""
    import torch
    import torch.distributed as tdist

    if info.world_size == 1:
        return folder
    obj = [None]
    if info.is_main:
        obj = [{"files": {f: (folder / f).stat().st_size for f in folder_files(folder)}, "path": str(folder)}]
    tdist.broadcast_object_list(obj, src=0)
    listing = obj[0]
    local = dest
    if shared and (Path(listing["path"]) / "meta.json").is_file():  # --data_dir on shared storage
        local = Path(listing["path"])
    have = (local / "meta.json").is_file() or info.local_rank != 0
    flags = [None] * info.world_size
    tdist.all_gather_object(flags, have)
    if not all(flags):
        tmp = dest.parent / f".{dest.name}.{socket.gethostname()}.{os.getpid()}.recv"
        writing = not have
        if writing:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            log.warning("%s: receiving the prepared token files from rank 0", info.host)
        chunk = 16 << 20
        for name, size in sorted(listing["files"].items()):
            out = None
            if writing:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                out = (tmp / name).open("wb")
            src = (folder / name).open("rb") if info.is_main else None
            for start in range(0, size, chunk):
                n = min(chunk, size - start)
                buf = torch.from_numpy(np.frombuffer(src.read(n), dtype=np.uint8).copy()) if src else \
                    torch.empty(n, dtype=torch.uint8)
                tdist.broadcast(buf, src=0)
                if out:
                    out.write(buf.numpy().tobytes())
            for fh in (out, src):
                if fh:
                    fh.close()
        if writing:
            local = publish(tmp, dest)
    tdist.barrier()  # local ranks wait for their node's copy
    return local if (local / "meta.json").is_file() else dest


def prepared_folder(data: DataArguments, model: ModelArguments, info) -> Path:
    """The prepared folder on this node: --data_dir, the cache hit, or rank 0's fresh preparation."""
    import torch.distributed as tdist

    key = None
    folder = None
    if info.is_main:
        if data.data_dir:
            folder = Path(data.data_dir)
            if not (folder / "meta.json").is_file():
                raise ValueError(f"--data_dir {folder} has no meta.json; pass a folder made by --prepare_only")
            key = "dir-" + hashlib.sha256((folder / "meta.json").read_bytes()).hexdigest()[:16]
        else:
            key = cache_key(data, model)
            folder = cache_root(data) / key
            if (folder / "meta.json").is_file():
                log.info("prepared tokens found in %s (reused)", folder)
            else:
                folder.parent.mkdir(parents=True, exist_ok=True)
                t = time.monotonic()
                prepare(data, model, folder)
                log.info("prepared tokens in %s (%.1fs)", folder, time.monotonic() - t)
    if info.world_size > 1:
        obj = [key]
        tdist.broadcast_object_list(obj, src=0)
        key = obj[0]
    return share_from_rank0(folder, cache_root(data) / key, info, shared=bool(data.data_dir))


class TokenBlocks:
    """Fixed blocks of block_size tokens from a memory-mapped token file (labels = inputs; the
    model shifts them). The file is opened lazily, so the dataset pickles into loader workers."""

    def __init__(self, path: Path, block_size: int, limit: int | None = None):
        self.path, self.block_size = path, block_size
        tokens = path.stat().st_size // np.dtype(np.uint16).itemsize
        self.blocks = tokens // block_size
        if limit:
            self.blocks = min(self.blocks, limit)
        self._arr = None

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, i: int) -> dict:
        import torch

        if i < 0 or i >= self.blocks:
            raise IndexError(i)
        if self._arr is None:
            self._arr = np.memmap(self.path, dtype=np.uint16, mode="r")
        x = torch.from_numpy(self._arr[i * self.block_size:(i + 1) * self.block_size].astype(np.int64))
        return {"input_ids": x, "labels": x}

    def __getstate__(self):
        return {**self.__dict__, "_arr": None}

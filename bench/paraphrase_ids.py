"""The glue job's token ids of the bundled paraphrase pairs without a tokenizer download: a table shipped here.

The bundled set (training/jobs/data/paraphrase, written from templates) uses 298 distinct words. paraphrase_ids.json
holds each word's wordpiece ids as the glue job's tokenizer (all-MiniLM-L6-v2's, bert-base-uncased's vocabulary)
gives them, so that BERT's own word split (lower case, accents stripped, each punctuation mark a word) and a table
look-up give the job's ids, [CLS] a [SEP] b [SEP], and its token type ids, bit for bit (tested against the
tokenizer). A word not in the table (other data) gets one id hashed from it (crc32), counted in `unknown`.
Needs only the standard library and torch (for the batches), so a bench that uses it runs wherever torch and
transformers are installed, with no hub connection.

    python bench/paraphrase_ids.py --write   # rebuild the table with the real tokenizer (the project's venv)
"""
from __future__ import annotations

import csv
import json
import random
import re
import sys
import unicodedata
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "training" / "jobs" / "data" / "paraphrase"
TABLE = Path(__file__).with_name("paraphrase_ids.json")
MAX_LENGTH = 128  # the glue job's --max_seq_length
_WORD = re.compile(r"[^\W_]+|[^\w\s]|_")


def words(text: str) -> list[str]:
    """BERT's basic split for uncased vocabularies: lower case, accents stripped, runs of letters and digits, each
    punctuation mark on its own."""
    text = unicodedata.normalize("NFD", text.lower())
    return _WORD.findall("".join(c for c in text if unicodedata.category(c) != "Mn"))


class WordIds:
    """The table's tokenizer: encode(a, b) gives what the job's tokenizer gives for the pair (truncation to
    MAX_LENGTH, longest first)."""

    def __init__(self, path: Path = TABLE):
        table = json.loads(path.read_text())
        self.words: dict[str, list[int]] = table["words"]
        self.cls, self.sep, self.pad = table["cls"], table["sep"], table["pad"]
        self.vocab_size = table["vocab_size"]
        self.tokenizer = table["tokenizer"]
        self.unknown = 0  # words hashed so far

    def ids(self, text: str) -> list[int]:
        out = []
        for w in words(text):
            got = self.words.get(w)
            if got is None:
                self.unknown += 1
                got = [1000 + zlib.crc32(w.encode()) % (self.vocab_size - 1000)]  # past the special and unused ids
            out += got
        return out

    def encode(self, a: str, b: str, max_length: int = MAX_LENGTH) -> tuple[list[int], list[int]]:
        """(input ids, token type ids) of the pair."""
        x, y = self.ids(a), self.ids(b)
        while len(x) + len(y) > max_length - 3:
            (x if len(x) > len(y) else y).pop()
        return [self.cls, *x, self.sep, *y, self.sep], [0] * (len(x) + 2) + [1] * (len(y) + 1)


def rows(split: str = "train", data: Path = DATA) -> list[dict]:
    path = data / f"{split}.csv"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the bench reads the bundled paraphrase pairs from the checkout's "
                         "training/jobs/data/paraphrase; copy training/ beside bench/")
    with path.open() as f:
        return list(csv.DictReader(f))


def examples(table: WordIds | None = None, split: str = "train") -> list[tuple[list[int], list[int], int]]:
    """(input ids, token type ids, label) of every pair of the split, in file order."""
    table = table or WordIds()
    return [(*table.encode(r["sentence1"], r["sentence2"]), int(r["label"])) for r in rows(split)]


def collate(part, multiple: int = 1, pad: int = 0):
    """A batch as the glue job's DataCollatorWithPadding makes it: padded to the longest (rounded up to a multiple),
    attention mask and token type ids, as tensors; and the labels."""
    import torch

    longest = max(len(ids) for ids, _, _ in part)
    width = -(-longest // multiple) * multiple
    ids = torch.full((len(part), width), pad, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (x, t, _) in enumerate(part):
        ids[i, :len(x)], types[i, :len(t)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(t), 1
    return ({"input_ids": ids, "token_type_ids": types, "attention_mask": mask},
            torch.tensor([label for _, _, label in part]))


def batches(steps: int, batch: int, multiple: int = 1, table: WordIds | None = None):
    """bench/compile_step.batches without its tokenizer: the pairs in a seeded shuffle, `steps` batches in turn,
    each padded to its longest pair (a multiple of `multiple`). Same tensors as it gives (tested)."""
    table = table or WordIds()
    data = examples(table)
    order = list(range(len(data)))
    random.Random(42).shuffle(order)
    shuffled = [data[i] for i in order]
    return [collate(shuffled[i * batch % len(shuffled):][:batch], multiple, table.pad)
            for i in range(steps)]


def write(path: Path = TABLE) -> dict:
    """The table from the glue job's own tokenizer (needs the project's venv: its offline copy of the model)."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from training.jobs.common import DEFAULT_MODEL, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    seen = sorted({w for split in ("train", "validation") for r in rows(split)
                   for w in words(r["sentence1"]) + words(r["sentence2"])})
    table = {"tokenizer": DEFAULT_MODEL, "vocab_size": len(tok), "cls": tok.cls_token_id, "sep": tok.sep_token_id,
             "pad": tok.pad_token_id, "words": {w: tok(w, add_special_tokens=False)["input_ids"] for w in seen}}
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "words")
    lines = ",\n".join(f"  {json.dumps(w)}: {json.dumps(ids)}" for w, ids in table["words"].items())
    path.write_text(f'{{{head},\n"words": {{\n{lines}\n}}}}\n')  # a word a line
    return table


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    print(f"{len(write()['words'])} words written to {TABLE}")

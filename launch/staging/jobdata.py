"""The bundled jobs' flags and data files, checked before anything starts.

A data file the job cannot use (no rows, a missing column, a word where a label number goes) or a
flag out of range (--max_seq_length -5) would otherwise fail minutes later on every rank, after keys,
staging and a run folder. The rules restate the jobs' own (training/jobs/glue.py, qa.py, clm_data.py) with
the stdlib only: the operator may not have the training stack installed. What lives on the nodes (a
model folder, an absolute --output_dir) is checked there, over SSH, before launch.
"""
from __future__ import annotations

import codecs
import csv
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, fan_out, run
from core.errors import ClusterError
from launch.staging import jobflags

# Numeric job flags: flag -> (type, lowest, highest, lowest excluded). Others are left to the job's parser.
NUMBERS = {
    **{f: (int, 1, None, False) for f in (
        "--max_seq_length", "--per_device_train_batch_size", "--per_device_eval_batch_size",
        "--gradient_accumulation_steps", "--max_train_samples", "--max_eval_samples", "--doc_stride", "--n_best_size",
        "--max_answer_length", "--block_size", "--pad_to_multiple_of", "--tokenizer_vocab_size")},
    "--seed": (int, 0, None, False),
    "--num_train_epochs": (float, 0, None, True),
    "--learning_rate": (float, 0, None, True),
    "--weight_decay": (float, 0, None, False),
    "--warmup_ratio": (float, 0, 1, False),
    "--validation_split_percentage": (float, 0, 50, True),
}
SUFFIXES = {"glue": (".csv", ".json", ".jsonl"), "qa": (".json",), "clm": (".txt", ".json", ".jsonl")}
MAX_ROWS = 200_000  # rows of a JSON-lines corpus looked at; a large corpus is sampled, not read whole
MAX_TEXT = 64 << 20  # bytes of a .txt corpus decoded
# A hub id (transformers' rule): name or org/name of letters, digits, '-', '_', '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def flag_values(args: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) for every --flag in the job arguments ('--f v', '--f=v'; None when no value follows)."""
    return jobflags.pairs(args)


def check(job: str, args: list[str], files: list[tuple[str, str]]) -> None:
    """Flags and data files of a bundled job; raises ClusterError with the first problem and its fix."""
    values = flag_values(args)
    for flag, value in values:
        if flag in NUMBERS:
            _number(flag, value, *NUMBERS[flag])
    for flag in ("--model_name_or_path", "--output_dir", "--text_column"):
        if flag in dict(values) and not dict(values)[flag]:
            raise ClusterError(f"{flag} needs a value", fix="pass it after the flag or leave the flag out")
    model = dict(values).get("--model_name_or_path") or ""
    if model and not model.startswith(("/", "./", "../", "~")) and not HUB_ID.fullmatch(model):
        raise ClusterError(f"--model_name_or_path {model!r} is neither a hub id (name or org/name) nor a path", fix="pass "
                           "a hub id such as bert-base-cased or the model folder's absolute path on the nodes")
    for flag, path in files:
        if flag == "--test_file" and job != "glue":
            raise ClusterError(f"--test_file is not a flag of the {job} job", fix="pass --train_file and --validation_file")
        if Path(path).suffix not in SUFFIXES[job]:
            raise ClusterError(f"{flag} {path}: the {job} job reads {' or '.join(SUFFIXES[job])} files", fix="convert it")
    if job == "glue":
        _glue(files)
    elif job == "qa":
        for flag, path in files:
            _squad(flag, *_stat(path))
    elif job == "clm":
        column = dict(values).get("--text_column") or "text"
        for flag, path in files:
            _corpus(flag, *_stat(path), column)


def _number(flag: str, value: str | None, kind, low, high, strict: bool) -> None:
    what = "a whole number" if kind is int else "a number"
    span = f"{'above' if strict else 'at least'} {low}" + (f" and at most {high}" if high is not None else "")
    if value is None:
        raise ClusterError(f"{flag} needs a value", fix=f"pass {what} {span}")
    try:
        n = kind(value)
    except (TypeError, ValueError):
        raise ClusterError(f"{flag} {value!r} is not {what}", fix=f"pass {what} {span}") from None
    if n < low or (strict and n == low) or (high is not None and n > high):
        raise ClusterError(f"{flag} {value} is out of range", fix=f"pass {what} {span}")


def _stat(path: str) -> tuple[str, int, int]:
    st = Path(path).expanduser().stat()
    return str(Path(path).expanduser()), st.st_size, st.st_mtime_ns  # the cache key: a changed file is read anew


def _records(flag: str, path: str, lines: bool = True, wrapped: bool = False):
    """(where, row) of a CSV (header line first), a JSON list of records, JSON lines (``lines``) or, where
    the job reads it (``wrapped``), {"data": [records]}."""
    if path.endswith(".csv"):
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                for row in reader:
                    if None in row:
                        raise ClusterError(f"{flag} {path} line {reader.line_num} has more fields than the header "
                                           f"({', '.join(reader.fieldnames)})", fix="quote text that holds commas")
                    yield f"line {reader.line_num}", row
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ClusterError(f"{flag} {path} is not a readable CSV file ({exc})", fix="save it as UTF-8 CSV") from None
        return
    text = _text(flag, path, None)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if not lines:
            raise ClusterError(f"{flag} {path} is not valid JSON ({exc.msg} at line {exc.lineno})", fix="fix it, or write "
                               "one JSON object per line in a .jsonl file") from None
        data = None  # JSON lines, read below
    if wrapped and isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, list):
        yield from ((f"record {i + 1}", r) for i, r in enumerate(data))
        return
    if data is not None and (not lines or len([ln for ln in text.splitlines() if ln.strip()]) > 1):
        raise ClusterError(f"{flag} {path} is one JSON {type(data).__name__}, not records", fix="write a list of records "
                           "or one JSON object per line")
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {i}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise ClusterError(f"{flag} {path} line {i} is not JSON ({exc.msg})", fix="write one JSON object per "
                               "line or a list of records") from None


def _text(flag: str, path: str, limit: int | None) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read() if limit is None else f.read(limit)
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=limit is None or len(raw) < limit)
    except UnicodeDecodeError as exc:
        raise ClusterError(f"{flag} {path} is not UTF-8 text (byte {exc.start})", fix="save it as UTF-8") from None


@lru_cache(maxsize=16)
def _glue_file(flag: str, path: str, size: int, mtime: int) -> tuple[tuple[str, ...], frozenset, bool]:
    """(columns, labels, whether every label is a class id) of one glue data file; --test_file (predictions)
    needs no labels."""
    need_label = flag != "--test_file"
    columns: tuple[str, ...] | None = None
    keys: tuple[str, ...] = ()
    labels, ids = set(), True
    for where, row in _records(flag, path):
        if not isinstance(row, dict):
            raise ClusterError(f"{flag} {path} {where} is not a record of named fields", fix="write objects such as "
                               '{"sentence1": ..., "sentence2": ..., "label": 0}')
        if columns is None:
            columns = tuple(row)
            texts = [c for c in columns if c not in ("label", "idx")]
            if need_label and "label" not in columns:
                raise ClusterError(f"{flag} {path} has no 'label' column (columns: {', '.join(columns) or 'none'})", fix=
                                   "name the column of class ids 'label'")
            if not texts:
                raise ClusterError(f"{flag} {path} has no text column besides label/idx", fix="add sentence1 (and "
                                   "sentence2) columns")
            keys = ("sentence1", "sentence2") if {"sentence1", "sentence2"} <= set(texts) else tuple(texts[:2])
        for key in keys:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ClusterError(f"{flag} {path} {where}: '{key}' is empty", fix="fill it or drop the row")
        label = row.get("label")
        if not need_label:
            continue
        if isinstance(label, str):
            text = label.strip()
            try:
                float(text)
            except ValueError:
                raise ClusterError(f"{flag} {path} {where}: label {label!r} is not a number", fix="the glue job needs "
                                   "class ids 0, 1, ... (or real numbers for regression): map the labels to "
                                   "numbers") from None
            ids = ids and re.fullmatch(r"[+-]?\d+", text) is not None
            labels.add(int(text) if ids else float(text))
        elif isinstance(label, (int, float)) and not isinstance(label, bool):
            ids = ids and isinstance(label, int)
            labels.add(label)
        else:
            raise ClusterError(f"{flag} {path} {where}: label {label!r} is not a number", fix="the glue job needs class "
                               "ids 0, 1, ... (or real numbers for regression)")
    if columns is None:
        raise ClusterError(f"{flag} {path} has no rows", fix="pass a file with a header line and at least one example")
    return columns, frozenset(labels), ids


def _glue(files: list[tuple[str, str]]) -> None:
    seen = {flag: (flag, path, _glue_file(flag, *_stat(path))) for flag, path in files}
    base = seen.get("--train_file") or seen.get("--validation_file")
    if base and "--test_file" in seen:  # predictions read the same text columns, labels or not
        (f1, p1, (cols1, _, _)), (f2, p2, (cols2, _, _)) = base, seen["--test_file"]
        texts1, texts2 = [c for c in cols1 if c not in ("label", "idx")], [c for c in cols2 if c not in ("label", "idx")]
        if set(texts1) != set(texts2):
            raise ClusterError(f"--test_file {p2} has text columns {', '.join(texts2)} but {f1} {p1} has "
                               f"{', '.join(texts1)}", fix="give it the same text columns")
    if "--train_file" not in seen or "--validation_file" not in seen:
        return
    (f1, p1, (cols1, labels1, ids1)), (f2, p2, (cols2, labels2, _)) = seen["--train_file"], seen["--validation_file"]
    if set(cols1) != set(cols2):
        raise ClusterError(f"{f2} {p2} has columns {', '.join(cols2)} but {f1} {p1} has {', '.join(cols1)}", fix="give "
                           "both files the same columns")
    if ids1 and not labels2 <= labels1:  # the job numbers the classes it saw in training
        extra = ", ".join(map(str, sorted(labels2 - labels1, key=str)))
        raise ClusterError(f"{f2} {p2} has label(s) {extra} that {f1} {p1} never has", fix="every class must occur in "
                           "the training data")


@lru_cache(maxsize=16)
def _squad(flag: str, path: str, size: int, mtime: int) -> None:
    """SQuAD JSON as training/jobs/qa.py reads it: the nested data/paragraphs/qas layout or flat records."""
    fix = "expected SQuAD JSON (context, question, id, answers with text and answer_start)"
    try:
        raw = json.loads(_text(flag, path, None))
    except json.JSONDecodeError as exc:
        raise ClusterError(f"{flag} {path} is not valid JSON ({exc.msg} at line {exc.lineno})", fix="pass a SQuAD JSON "
                           "file") from None
    entries = raw.get("data", raw) if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise ClusterError(f"{flag} {path} has no 'data' list of articles", fix=f"{fix}")
    questions = 0
    for i, article in enumerate(entries):
        if isinstance(article, dict) and isinstance(article.get("paragraphs"), list):
            for j, para in enumerate(article["paragraphs"]):
                where = f"data[{i}].paragraphs[{j}]"
                if not isinstance(para, dict) or not isinstance(para.get("context"), str):
                    raise ClusterError(f"{flag} {path}: {where} has no 'context' text", fix=f"{fix}")
                for k, qa in enumerate(para.get("qas") or []):
                    golds = qa.get("answers") if isinstance(qa, dict) else None
                    if not isinstance(golds, list) or not all(isinstance(a, dict) for a in golds):
                        raise ClusterError(f"{flag} {path}: {where}.qas[{k}] has no 'answers' list", fix=f"{fix}")
                    _question(flag, path, f"{where}.qas[{k}]", qa, para["context"],
                              [a.get("text") for a in golds], [a.get("answer_start") for a in golds], fix)
                    questions += 1
        elif isinstance(article, dict) and {"context", "question", "answers"} <= set(article):
            answers = article["answers"]
            if not isinstance(answers, dict) or not isinstance(answers.get("text"), list) \
                    or not isinstance(answers.get("answer_start"), list):
                raise ClusterError(f"{flag} {path}: data[{i}] 'answers' is not {{'text': [...], 'answer_start': "
                                   f"[...]}}", fix=f"{fix}")
            _question(flag, path, f"data[{i}]", article, article["context"], answers["text"],
                      answers["answer_start"], fix)
            questions += 1
        else:
            raise ClusterError(f"{flag} {path}: data[{i}] has neither 'paragraphs' nor context/question/answers", fix=f"{fix}")
    if not questions:
        raise ClusterError(f"{flag} {path} has no questions", fix=f"{fix}")


def _question(flag, path, where, qa, context, texts, starts, fix) -> None:
    if not isinstance(context, str) or not isinstance(qa.get("question"), str) or not qa["question"].strip():
        raise ClusterError(f"{flag} {path}: {where} has no 'question' text (or no 'context')", fix=f"{fix}")
    if len(texts) != len(starts):
        raise ClusterError(f"{flag} {path}: {where} has {len(texts)} answer text(s) but {len(starts)} "
                           f"answer_start(s)", fix=f"{fix}")
    for text, start in zip(texts, starts):
        if not isinstance(text, str):
            raise ClusterError(f"{flag} {path}: {where} has an answer without 'text'", fix=f"{fix}")
        try:
            start = int(start)
        except (TypeError, ValueError):
            raise ClusterError(f"{flag} {path}: {where} answer_start {start!r} is not a character offset", fix=
                               f"{fix}") from None
        if not 0 <= start <= len(context) - len(text):
            raise ClusterError(f"{flag} {path}: {where} answer_start {start} puts {text!r} outside its context of "
                               f"{len(context)} characters", fix="fix the offset")


@lru_cache(maxsize=16)
def _corpus(flag: str, path: str, size: int, mtime: int, column: str) -> None:
    """A clm corpus: text documents (.txt), or JSON records with the text column."""
    if path.endswith(".txt"):
        if not _text(flag, path, MAX_TEXT).strip():
            raise ClusterError(f"{flag} {path} has no text", fix="pass a corpus of documents separated by blank lines")
        return
    text = False
    for rows, (where, row) in enumerate(_records(flag, path, lines=path.endswith(".jsonl"), wrapped=True), 1):
        if not isinstance(row, dict) or row.get(column) is None:
            raise ClusterError(f"{flag} {path} {where} has no '{column}' field", fix="set --text_column to the field that "
                               "holds the text, or pass a .txt corpus")
        text = text or bool(str(row[column]).strip())
        if rows >= MAX_ROWS:
            return
    if not text:
        raise ClusterError(f"{flag} {path} holds no text", fix="pass a corpus with at least one document")


# On a node: a model folder must exist; an absolute output folder must be one the job can create and write
# (the folders this check makes are removed again).
NODE_CHECK = r"""
m=$1; o=$2
if [ -n "$m" ] && [ ! -e "$m" ]; then echo "model-missing"; fi
if [ -n "$o" ]; then
  d=$o; top=
  while [ ! -e "$d" ]; do top=$d; d=$(dirname "$d"); done
  if mkdir -p "$o" 2>/dev/null && touch "$o/.xc-write-test" 2>/dev/null; then rm -f "$o/.xc-write-test"
  else echo "output-unwritable"; fi
  if [ -n "$top" ]; then find "$top" -depth -type d -empty -delete 2>/dev/null; fi
fi
echo checked
"""


def node_paths(args: list[str]) -> tuple[str, str]:
    """(model folder, absolute output folder) that the job flags name on the nodes; '' where there is none."""
    values = dict(flag_values(args))
    model = values.get("--model_name_or_path") or ""
    out = values.get("--output_dir") or ""
    return (model if model.startswith("/") else ""), (out if out.startswith("/") else "")


def check_on_nodes(nodes: list[Node], args: list[str]) -> None:
    """The model folder on every node, an absolute --output_dir on node 0 (which writes the results)."""
    model, out = node_paths(args)
    if not model and not out:
        return

    def one(node: Node) -> str:
        mine = out if node is nodes[0] else ""
        if not model and not mine:
            return "checked"
        with connect(node) as conn:
            res = run(conn, f"sh -c {shlex.quote(NODE_CHECK)} - {shlex.quote(model)} {shlex.quote(mine)}", timeout=30)
        return res.stdout

    results = fan_out(nodes, one, "checking the job's paths on the nodes")
    missing = [n.name for n, r in zip(nodes, results) if "model-missing" in r]
    if missing:
        raise ClusterError(f"--model_name_or_path {model} does not exist on {', '.join(missing)}", fix="copy the model "
                           "folder there or pass a hub id")
    if "output-unwritable" in results[0]:
        raise ClusterError(f"--output_dir {out} cannot be created or written on {nodes[0].name}", fix="pass a writable "
                           "folder or leave it out (output/ in the run folder)")

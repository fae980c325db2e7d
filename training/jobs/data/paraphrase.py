"""Writes the bundled paraphrase data set (MRPC's columns: sentence1, sentence2, label, idx).

News-style sentence pairs of realistic length (MRPC averages ~22 words a sentence).
label 1 = the second sentence restates the first (synonyms, reordered clauses, moved
attribution); label 0 = it reports something else: a different actor, a changed figure,
an opposite movement, or another event about the same actor. Deterministic for a seed.

    python -m training.jobs.data.paraphrase --out training/jobs/data/paraphrase
"""
from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

ACTORS = [
    "Microsoft", "the European Commission", "Boeing", "the Federal Reserve", "Toyota", "Pfizer",
    "the city council", "Oracle", "the health ministry", "Siemens", "the union", "Walmart",
    "the Senate committee", "Intel", "Nestle", "the central bank", "Airbus", "the school board",
    "Samsung", "the prosecutors", "Shell", "the World Bank", "Vodafone", "the police department",
]
# (trailing attribution, its paraphrase, the paraphrase as a leading clause)
SPEAKERS = [
    ("a spokesman said", "according to a spokesman", "according to a spokesman,"),
    ("officials said on Tuesday", "officials said Tuesday", "officials said Tuesday that"),
    ("the company said in a statement", "a statement from the company said", "the company said in a statement that"),
    ("analysts said", "according to analysts", "according to analysts,"),
    ("people familiar with the matter said", "sources close to the matter said", "sources close to the matter said that"),
]
EVENTS = [
    # (verb phrase, paraphrase of verb phrase, opposite verb phrase, object with {n}, object paraphrase)
    ("reported a {n} percent rise in", "posted a {n} percent increase in", "reported a {n} percent drop in",
     "quarterly profit compared with the same period last year", "profit for the quarter from a year earlier"),
    ("agreed to buy", "has agreed to acquire", "decided not to buy",
     "a smaller rival for about {n} million dollars in cash", "a smaller competitor for roughly {n} million dollars in cash"),
    ("plans to cut", "intends to eliminate", "plans to add",
     "about {n} hundred jobs over the next two years", "roughly {n} hundred positions during the next two years"),
    ("approved a budget of", "signed off on a budget of", "rejected a budget of",
     "{n} million dollars for new schools and roads", "{n} million dollars for new roads and schools"),
    ("raised its forecast for", "lifted its outlook for", "lowered its forecast for",
     "annual sales to {n} billion dollars", "full-year revenue to {n} billion dollars"),
    ("opened an investigation into", "launched a probe into", "closed an investigation into",
     "{n} contracts awarded without competitive bidding", "{n} contracts that were awarded without open bidding"),
    ("will invest", "is set to spend", "will withdraw",
     "{n} billion dollars in a new plant in Ohio", "{n} billion dollars on a new factory in Ohio"),
    ("recalled", "is recalling", "declined to recall",
     "about {n} thousand vehicles because of faulty brakes", "roughly {n} thousand cars over defective brakes"),
]
TIMES = [
    ("on Monday", "Monday"), ("late on Thursday", "on Thursday evening"), ("this week", "in recent days"),
    ("earlier this month", "at the start of the month"), ("on Friday", "Friday"),
]
TAILS = [
    ("sending its shares higher in early trading", "and its stock rose in early trading"),
    ("in a move that surprised many investors", "a step that caught many investors off guard"),
    ("despite weaker demand in Europe", "even though demand in Europe has weakened"),
    ("as part of a broader restructuring plan", "under a wider plan to restructure"),
    ("following months of negotiations", "after several months of talks"),
]


def _sentence(actor, verb, obj, time, tail, speaker, front_time=False, lead=None):
    core = f"{time}, {actor} {verb} {obj}, {tail}" if front_time else f"{actor} {verb} {obj} {time}, {tail}"
    text = f"{lead} {core}" if lead else f"{core}, {speaker}"
    return text[0].upper() + text[1:] + "."


def make_pair(rng: random.Random) -> tuple[str, str, int]:
    actor = rng.choice(ACTORS)
    verb, verb_p, verb_neg, obj, obj_p = rng.choice(EVENTS)
    n = rng.randint(2, 95)
    time, time_p = rng.choice(TIMES)
    tail, tail_p = rng.choice(TAILS)
    speaker, speaker_p, lead_p = rng.choice(SPEAKERS)
    s1 = _sentence(actor, verb, obj.format(n=n), time, tail, speaker)
    kind = rng.random()
    if kind < 0.6:  # paraphrase
        s2 = _sentence(actor, verb_p, obj_p.format(n=n), time_p, tail_p, speaker_p,
                       front_time=rng.random() < 0.3, lead=lead_p if rng.random() < 0.3 else None)
        return s1, s2, 1
    kind = rng.choice(["actor", "figure", "opposite", "other"])
    if kind == "actor":
        actor = rng.choice([a for a in ACTORS if a != actor])
    elif kind == "figure":
        n = rng.choice([m for m in range(2, 96) if abs(m - n) > 10])
    elif kind == "opposite":
        verb_p = verb_neg
    else:
        verb, verb_p, verb_neg, obj, obj_p = rng.choice([e for e in EVENTS if e[0] != verb])
    s2 = _sentence(actor, verb_p, obj_p.format(n=n), time_p, tail_p, speaker_p,
                   front_time=rng.random() < 0.3, lead=lead_p if rng.random() < 0.3 else None)
    return s1, s2, 0


def write_split(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "label", "idx"])
        for idx in range(count):
            s1, s2, label = make_pair(rng)
            w.writerow([s1, s2, label, idx])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent / "paraphrase"))
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--validation", type=int, default=400)
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args(argv)
    out = Path(a.out)
    write_split(out / "train.csv", a.train, a.seed)
    write_split(out / "validation.csv", a.validation, a.seed + 1)


if __name__ == "__main__":
    main()

"""Writes the bundled encyclopedia-style data: a SQuAD v1.1 set and a plain-text corpus.

Fictional towns, companies and scientists, each an article of a few paragraphs in the register
of an encyclopedia. Paragraphs run 60-230 words (SQuAD's contexts average ~120 words, with a
long tail that needs --doc_stride); every fact sentence has several phrasings and every
question paraphrases its sentence, so answering needs more than word matching: a paragraph
holds several years, names and figures of the same type. Deterministic for a seed.

    python -m training.jobs.data.articles --out training/jobs/data
    # -> squad/train.json, squad/validation.json (SQuAD v1.1), corpus/train.txt, corpus/validation.txt
"""
from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

FIRST = ["Anna", "Pieter", "Margaret", "Tomas", "Elena", "Henrik", "Clara", "Jonas", "Sofia", "Walter", "Ines",
         "Edmund", "Marta", "Oskar", "Louise", "Arthur", "Helena", "Felix", "Rosa", "Daniel", "Agnes", "Victor",
         "Irene", "Samuel", "Beatrix", "Conrad", "Lydia", "Matthias", "Eleanor", "Hugo", "Greta", "Julian"]
LAST = ["Halvorsen", "Brandt", "Okafor", "Lindqvist", "Moreau", "Castellano", "Whitcombe", "Novak", "Ferreira",
        "Ashdown", "Kowalski", "Vermeulen", "Sandoval", "Thorne", "Eriksen", "Marchetti", "Pemberton", "Haas",
        "Delacroix", "Abernethy", "Rossi", "Kettering", "Strand", "Villiers", "Mbeki", "Fairbairn", "Lund",
        "Carrow", "Dunmore", "Hollis", "Okonjo", "Reinholt"]
SYL1 = ["Var", "Kel", "Ash", "Mor", "Bren", "Hal", "Tor", "Wen", "Ost", "Lin", "Fal", "Grim", "Cal", "Dun",
        "Elm", "Rav", "Sel", "Thal", "Ber", "Nor"]
SYL2 = ["holm", "bridge", "ford", "stead", "wick", "dale", "mouth", "haven", "by", "thorpe", "mere", "field",
        "minster", "well", "burg", "hurst"]
RIVERS = ["Ossel", "Tarn", "Weyle", "Liss", "Orva", "Brenne", "Kalder", "Mure", "Ysel", "Derwen", "Avra", "Sorne"]
REGIONS = ["the province of Lerma", "the Halden district", "the county of Westmarch", "the Ostrava region",
           "the valley of the Upper Tarn", "the coastal province of Serra", "the Kelmark uplands"]
COUNTRIES = ["Norland", "Aldoria", "the Republic of Vessia", "Caravel", "Estmark", "Lusenia"]
LANDMARKS = ["Church of St. Aldric", "Old Corn Exchange", "Marten Bridge", "Town Hall", "Clock Tower",
             "Grain Museum", "Weavers' Hall", "Observatory", "Municipal Library", "Harbour Lighthouse"]
PRODUCTS = ["woollen cloth", "clay pipes", "glass bottles", "paper", "ship rope", "cast-iron stoves",
            "leather goods", "printed maps", "pocket watches", "porcelain", "brass instruments", "canned fish"]
COMPANY_NOUNS = ["Instruments", "Engineering", "Optics", "Textiles", "Chemicals", "Foods", "Machine Works",
                 "Electric", "Publishing", "Shipping"]
COMPANY_PRODUCTS = ["precision scales", "railway signals", "microscope lenses", "industrial dyes",
                    "frozen vegetables", "printing presses", "marine engines", "electric meters",
                    "school textbooks", "cargo cranes", "surgical instruments", "water turbines"]
FIELDS = ["organic chemistry", "plant genetics", "marine biology", "number theory", "seismology",
          "crystallography", "astronomy", "medieval history", "linguistics", "metallurgy", "economics"]
PRIZES = ["the Halvard Medal", "the Lindqvist Prize", "the Royal Society's gold medal", "the Orva Award",
          "the National Science Prize", "the Fairbairn Lectureship"]
BOOK_A = ["The Measure of", "A Short History of", "On the Nature of", "Notes on", "The Architecture of",
          "Letters on"]
BOOK_B = ["Rivers", "Light", "Salt", "Small Numbers", "the Earth's Crust", "Seeds", "Tides", "Old Languages",
          "Iron", "Markets"]

# Sentences without facts to ask about, per kind of article: they give paragraphs their
# realistic length and put distance between the facts.
FILLER = {
    "town": [
        "The surrounding countryside is mostly farmland, with scattered woods and a few small villages.",
        "Much of the old centre was rebuilt after a fire in the nineteenth century destroyed several streets.",
        "A weekly market is still held in the main square, as it has been for several hundred years.",
        "The climate is mild, although winters can be wet and the river sometimes floods the lower meadows.",
        "Local historians have argued for decades about the origin of the name, and no explanation is accepted by all.",
        "A railway line reached the area in the second half of the nineteenth century and changed its economy.",
        "Several buildings from this period survive and are protected as part of the national heritage register.",
        "During the war the barracks outside the walls were used by the army to store supplies.",
        "A small museum near the station documents this history with photographs, tools and original letters.",
        "Visitors mostly come in the summer, when the festival fills the streets with music and market stalls.",
        "The population grew steadily until the middle of the twentieth century and has declined slowly since.",
        "A new bypass opened in the 1990s and took most of the heavy traffic away from the narrow streets.",
        "The parish registers, which survive almost complete, are an important source for family historians.",
        "Two secondary schools, a hospital and a sports centre serve the town and the villages around it.",
    ],
    "company": [
        "In its early years the firm struggled to find customers and twice came close to closing.",
        "Expansion abroad began after the Second World War, first into neighbouring countries and later overseas.",
        "The original workshop still stands and now houses a small collection of early products and drawings.",
        "A long strike in the 1970s led to a new agreement on working hours that was copied across the industry.",
        "Research and development is carried out at a laboratory near the main factory.",
        "The company has been criticised by environmental groups over waste from its older plants.",
        "Financial difficulties in the following decade forced a series of reorganisations and sales of property.",
        "Most of its sales now come from export markets in Europe and Asia.",
        "Its apprenticeship scheme trains several hundred young people every year.",
        "The share price fell sharply during the financial crisis but recovered within three years.",
    ],
    "person": [
        "Colleagues remembered a careful and patient teacher who answered every letter received.",
        "The results were not fully appreciated until much later, when new instruments made them easier to test.",
        "Most of the early correspondence has been lost, although a few notebooks are kept in the university library.",
        "Several of the students from these years went on to lead research groups of their own.",
        "The early papers were written in a plain style that made them popular with readers outside the field.",
        "A long dispute with a rival group over the priority of a discovery was settled only after both had died.",
        "Critics at the time were divided, but the work was widely reprinted and translated into several languages.",
        "Field work took up most summers, often in remote places reached only on foot.",
        "Later in life the research turned to the history of the discipline and the training of teachers.",
        "A memorial lecture in this name is still held every year.",
    ],
}

def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def place(rng: random.Random) -> str:
    return rng.choice(SYL1) + rng.choice(SYL2)


def number(rng: random.Random, lo: int, hi: int) -> str:
    return f"{rng.randint(lo, hi):,}"


@dataclass
class Fact:
    """One sentence (phrasings with {slots}) and, per answer slot, the questions about it."""
    phrasings: list[str]
    slots: dict
    asks: dict[str, list[str]]


@dataclass
class Paragraph:
    context: str
    qas: list[dict] = field(default_factory=list)


def _fill(template: str, slots: dict) -> tuple[str, dict[str, int]]:
    """Format the template; return the text and the character offset of every slot in it."""
    at: dict[str, int] = {}
    out, pos = "", 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out += template[pos:m.start()]
        at.setdefault(m.group(1), len(out))
        out += str(slots[m.group(1)])
        pos = m.end()
    return out + template[pos:], at


def town_facts(rng: random.Random) -> tuple[str, str, list[Fact]]:
    t, founder, architect = place(rng), person(rng), person(rng)
    founded = rng.randint(1180, 1790)
    s = {"t": t, "river": rng.choice(RIVERS), "founder": founder, "architect": architect, "mayor": person(rng),
         "founded": founded, "built": rng.randint(founded + 40, 1935),
         "census": rng.choice([1901, 1951, 1971, 1991, 2001, 2011, 2021]), "pop": number(rng, 2000, 90000),
         "region": rng.choice(REGIONS), "country": rng.choice(COUNTRIES), "landmark": rng.choice(LANDMARKS),
         "product": rng.choice(PRODUCTS), "twin": place(rng), "elected": rng.randint(1995, 2022)}
    intro = rng.choice(["{t} is a market town in {region}, {country}, on the banks of the river {river}.",
                        "{t} is a town in {region} of {country}, where the river {river} leaves the hills."])
    facts = [
        Fact(["The town was founded in {founded} by {founder}, a wool merchant from the coast.",
              "According to the town charter, {founder} established the settlement in {founded}.",
              "{founder}, a minor noble, laid out the first streets of {t} in {founded}."], s,
             {"founded": ["When was {t} founded?", "In what year was {t} established?",
                          "What year did {founder} found the town?"],
              "founder": ["Who founded {t}?", "Who established the settlement of {t}?",
                          "Who is credited with founding {t}?"]}),
        Fact(["At the {census} census the town had a population of {pop}.",
              "The {census} census recorded {pop} inhabitants.",
              "In {census} some {pop} people lived in {t} and the surrounding parishes."], s,
             {"pop": ["What was the population of {t} in {census}?",
                      "How many inhabitants did the {census} census record in {t}?",
                      "How many people lived in {t} in {census}?"]}),
        Fact(["Its best-known building, the {landmark}, was completed in {built} to designs by {architect}.",
              "The {landmark} was designed by the architect {architect} and finished in {built}.",
              "{architect} drew up the plans for the {landmark}, which opened in {built}."], s,
             {"architect": ["Who designed the {landmark}?", "Which architect was responsible for the {landmark}?",
                            "Whose plans were used for the {landmark} in {t}?"],
              "built": ["When was the {landmark} completed?", "In what year was the {landmark} finished?"]}),
        Fact(["For centuries the economy of {t} depended on the making of {product}.",
              "The town became known throughout {country} for its {product}, made in small workshops."], s,
             {"product": ["What was {t} known for making?", "What did the workshops of {t} produce?",
                          "On the making of what did the economy of {t} depend?"]}),
        Fact(["The current mayor, {mayor}, was elected in {elected}.",
              "{mayor} has served as mayor since {elected}."], s,
             {"mayor": ["Who is the mayor of {t}?", "Who was elected mayor of {t} in {elected}?"],
              "elected": ["When was the mayor of {t} elected?", "Since what year has {mayor} been mayor?"]}),
        Fact(["{t} is twinned with {twin}, a town of similar size across the border.",
              "Since the 1960s the town has had a partnership with {twin}."], s,
             {"twin": ["Which town is {t} twinned with?", "With which town does {t} have a partnership?"]}),
    ]
    return "town", intro.format(**s), facts


def company_facts(rng: random.Random) -> tuple[str, str, list[Fact]]:
    founded = rng.randint(1840, 1985)
    s = {"c": f"{rng.choice(LAST)} {rng.choice(COMPANY_NOUNS)}", "founder": person(rng), "partner": person(rng),
         "founded": founded, "hq": place(rng), "product": rng.choice(COMPANY_PRODUCTS),
         "staff": number(rng, 300, 48000), "ceo": person(rng),
         "buyer": f"{rng.choice(LAST)} {rng.choice(COMPANY_NOUNS)}",
         "bought": rng.randint(founded + 20, 2020), "country": rng.choice(COUNTRIES),
         "ceo_year": rng.randint(2005, 2023)}
    intro = rng.choice(["{c} is a manufacturing company based in {hq}, {country}.",
                        "{c} is a {country} firm with its headquarters in the town of {hq}."])
    facts = [
        Fact(["The firm was started in {founded} by {founder} and {partner} in a rented workshop.",
              "{founder} founded the company in {founded} together with the engineer {partner}."], s,
             {"founded": ["When was {c} founded?", "In what year did {founder} start {c}?",
                          "What year was the company established?"],
              "founder": ["Who founded {c}?", "Who started the firm in {founded}?"]}),
        Fact(["Its main products are {product}, which it sells in more than forty countries.",
              "Today the company is best known for its {product}."], s,
             {"product": ["What does {c} make?", "What is {c} best known for producing?",
                          "What are the main products of {c}?"]}),
        Fact(["It employs about {staff} people.", "The company has a workforce of roughly {staff}.",
              "At the end of the last financial year it had {staff} employees."], s,
             {"staff": ["How many people does {c} employ?", "How large is the workforce of {c}?"]}),
        Fact(["In {bought} the business was acquired by {buyer}, although it kept its own name.",
              "{buyer} bought the company in {bought}."], s,
             {"buyer": ["Which company acquired {c}?", "Who bought {c} in {bought}?"],
              "bought": ["When was {c} acquired?", "In what year did {buyer} buy {c}?"]}),
        Fact(["{ceo} has been chief executive since {ceo_year}.",
              "The company has been led by {ceo} since {ceo_year}."], s,
             {"ceo": ["Who is the chief executive of {c}?", "Who has led {c} since {ceo_year}?"]}),
    ]
    return "company", intro.format(**s), facts


def scientist_facts(rng: random.Random) -> tuple[str, str, list[Fact]]:
    born = rng.randint(1820, 1960)
    s = {"p": person(rng), "born": born, "town": place(rng), "field": rng.choice(FIELDS),
         "country": rng.choice(COUNTRIES), "uni": f"the University of {place(rng)}", "teacher": person(rng),
         "prize": rng.choice(PRIZES), "prize_year": born + rng.randint(35, 60),
         "book": f"{rng.choice(BOOK_A)} {rng.choice(BOOK_B)}", "book_year": born + rng.randint(30, 55),
         "died": born + rng.randint(62, 94)}
    intro = rng.choice(["{p} ({born}-{died}) was a {country} scientist who worked in {field}.",
                        "{p} was a researcher in {field} from {country}, active for more than four decades."])
    facts = [
        Fact(["{p} was born in {born} in {town}, the youngest of five children.",
              "Born in {town} in {born}, {p} showed an early interest in collecting stones and plants."], s,
             {"town": ["Where was {p} born?", "In which town was {p} born?"],
              "born": ["When was {p} born?", "In what year was {p} born?"]}),
        Fact(["After studying at {uni} under {teacher}, {p} stayed there as a lecturer.",
              "{p} studied at {uni}, where the supervisor was {teacher}."], s,
             {"uni": ["Where did {p} study?", "At which university did {p} study?"],
              "teacher": ["Who supervised {p}?", "Under whom did {p} study?"]}),
        Fact(["In {prize_year} {p} received {prize} for work in {field}.",
              "The award of {prize} in {prize_year} brought wide recognition."], s,
             {"prize": ["Which prize did {p} receive?", "What award did {p} win in {prize_year}?"],
              "prize_year": ["When did {p} receive {prize}?", "In what year was {p} given {prize}?"]}),
        Fact(["The book {book}, published in {book_year}, summarised this research for a general audience.",
              "{p} is also remembered for a popular book, {book}, which appeared in {book_year}."], s,
             {"book": ["What book did {p} write?", "What was the title of the popular book by {p}?"],
              "book_year": ["When was {book} published?", "In what year did {book} appear?"]}),
    ]
    return "person", intro.format(**s), facts


KINDS = (town_facts, company_facts, scientist_facts)


def article(rng: random.Random, paragraphs: int) -> list[Paragraph]:
    """An article: an intro paragraph and follow-ups; each fact appears once, with its questions."""
    kind, intro, facts = rng.choice(KINDS)(rng)
    rng.shuffle(facts)
    per = -(-len(facts) // paragraphs)
    out = []
    for i in range(paragraphs):
        chunk = facts[i * per:(i + 1) * per]
        if not chunk:
            break
        sentences: list[tuple[str, Fact | None, dict]] = [(intro, None, {})] if i == 0 else []
        for fact in chunk:
            text, at = _fill(rng.choice(fact.phrasings), fact.slots)
            sentences.append((text, fact, at))
        for filler in rng.sample(FILLER[kind], rng.randint(2, 7)):  # realistic, varied lengths
            sentences.insert(rng.randint(1 if i == 0 else 0, len(sentences)), (filler, None, {}))
        context, qas = "", []
        for text, fact, at in sentences:
            start = len(context) + (1 if context else 0)
            context = f"{context} {text}" if context else text
            if fact is None:
                continue
            for slot, questions in fact.asks.items():
                if slot not in at:  # this phrasing leaves the slot out
                    continue
                question = rng.choice(questions).format(**fact.slots)
                qas.append({"question": question,
                            "answers": [{"text": str(fact.slots[slot]), "answer_start": start + at[slot]}]})
        out.append(Paragraph(context, qas))
    return out


def squad_split(count_articles: int, seed: int, prefix: str) -> dict:
    rng = random.Random(seed)
    data, n = [], 0
    for a in range(count_articles):
        paragraphs = []
        for p in article(rng, rng.randint(1, 2)):
            qas = []
            for qa in p.qas:
                assert p.context[qa["answers"][0]["answer_start"]:].startswith(qa["answers"][0]["text"])
                qas.append({"id": f"{prefix}{n:05d}", **qa})
                n += 1
            paragraphs.append({"context": p.context, "qas": qas})
        data.append({"title": f"{prefix}article_{a:04d}", "paragraphs": paragraphs})
    return {"version": "1.1", "data": data}


def corpus_split(count_articles: int, seed: int) -> str:
    """Articles separated by blank lines, paragraphs by newlines: the documents of the CLM corpus."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count_articles):
        docs.append("\n".join(p.context for p in article(rng, rng.randint(2, 4))))
    return "\n\n".join(docs) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--seed", type=int, default=29)
    a = p.parse_args(argv)
    out = Path(a.out)
    (out / "squad").mkdir(parents=True, exist_ok=True)
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", 300, a.seed), ("validation", 60, a.seed + 1)):
        split = squad_split(count, seed, prefix=name[0])
        (out / "squad" / f"{name}.json").write_text(json.dumps(split) + "\n")
    for name, count, seed in (("train", 350, a.seed + 2), ("validation", 40, a.seed + 3)):
        (out / "corpus" / f"{name}.txt").write_text(corpus_split(count, seed))


if __name__ == "__main__":
    main()

"""A RAG question set with known answers: fictional documents full of names and numbers, and
questions whose answer is one fact of one document.

Every document is a short report on an invented thing (a bridge, a ship, an expedition, a
company, ...): its name, where, when, who, and several numbers, in about 230 words, with filler
sentences that give the model something to read past. A question asks for one fact (a year, a
name, a number, a place) and is answered right when the reply contains it. Everything is drawn
from one seeded ``random.Random``: the same seed gives the same corpus on any machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ("ka", "lo", "mir", "ven", "dra", "sel", "tor", "bri", "nua", "gal", "qua", "rin",
             "pho", "zet", "lum", "ost", "hel", "vard", "ima", "cor")  # fmt: skip
FIRST_NAMES = ("Hanna", "Ilse", "Tomas", "Birgit", "Oren", "Mireille", "Kasimir", "Edda",
               "Lucan", "Petra", "Anselm", "Greta", "Ruben", "Yara", "Dorian", "Selma")  # fmt: skip
KINDS = (
    ("The {name} Bridge", "was completed", "engineer", "meters long"),
    ("The research ship {name}", "was launched", "captain", "meters long"),
    ("The {name} expedition", "set out", "leader", "kilometers long"),
    ("The {name} Trading Company", "was founded", "founder", "employees strong"),
    ("The {name} Observatory", "opened", "director", "meters high"),
    ("The {name} Canal", "was opened", "surveyor", "kilometers long"),
)
FILLER = (
    "Local records describe the work as slow and often interrupted by weather.",
    "Several letters from that period survive in the town archive.",
    "Visitors today can read a short plaque about its history near the entrance.",
    "The project was discussed at length in the regional newspaper of the time.",
    "Later accounts disagree on many small details of its early years.",
    "A museum exhibition in recent years brought renewed attention to it.",
    "Its original drawings were rediscovered during a renovation of the archive.",
    "Historians consider it a typical example of the ambitions of its era.",
    "Photographs from the opening show a large crowd gathered despite the rain.",
    "A small booklet about it is still sold in the shop across the square.",
    "The work employed many people from the surrounding villages for several seasons.",
    "Some of the tools used at the time are kept in a glass case in the hall.",
    "School classes from the district visit it every spring as part of their lessons.",
    "The design was changed twice before the final plans were approved by the council.",
    "Travel writers of the next decade mentioned it in nearly every guide to the region.",
    "Its name was chosen after a long public debate in the town hall.",
)


@dataclass(frozen=True)
class Document:
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    doc: int  # index of the document that holds the answer
    text: str
    answer: str

    def is_right(self, reply: str) -> bool:
        return self.answer.lower() in reply.lower()


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()


def corpus(num_docs: int, seed: int = 0) -> tuple[list[Document], list[Question]]:
    """``num_docs`` documents and, per document, four questions (one per kind of fact)."""
    rng = random.Random(seed)
    docs, questions = [], []
    used: set[str] = set()
    for i in range(num_docs):
        template, verb, role, unit = KINDS[i % len(KINDS)]
        name = _name(rng)
        while name in used:
            name = _name(rng)
        used.add(name)
        town, person = _name(rng), f"{rng.choice(FIRST_NAMES)} {_name(rng)}"
        year, size, cost = rng.randrange(1820, 1990), rng.randrange(120, 990), rng.randrange(11, 97)
        subject = template.format(name=name)
        facts = [
            f"{subject} {verb} in {year} near the town of {town}.",
            f"The {role} in charge was {person}, who had worked in the region for many years.",
            f"It is {size} {unit}, a figure that was often repeated in later reports.",
            f"The total cost came to {cost} thousand crowns, paid over several years.",
        ]
        filler = rng.sample(FILLER, 12)
        sentences = [facts[0], *filler[0:3], facts[1], *filler[3:6], facts[2], *filler[6:9],
                     facts[3], *filler[9:12]]  # fmt: skip
        title = f"Report {i + 1}: {subject}"
        docs.append(Document(title, f"{title}. " + " ".join(sentences)))
        questions += [
            Question(i, f"In which year {'did' if verb == 'set out' else 'was'} "
                     f"{subject[0].lower() + subject[1:]} "
                     f"{'set out' if verb == 'set out' else verb.split()[-1]}?", str(year)),
            Question(i, f"Who was the {role} of {subject[0].lower() + subject[1:]}?",
                     person.split()[1]),
            Question(i, f"Near which town is {subject[0].lower() + subject[1:]}?", town),
            Question(i, f"How much did {subject[0].lower() + subject[1:]} cost, in thousand "
                     "crowns?", str(cost)),
        ]  # fmt: skip
    return docs, questions


def stuffed(docs: list[Document], question: Question) -> str:
    """One user turn as LangChain's stuff chain writes it: the documents joined by blank lines,
    then the question."""
    context = "\n\n".join(d.text for d in docs)
    return (f"Answer the question using the documents below.\n\n{context}\n\n"
            f"Question: {question.text}\nAnswer with the fact only.")  # fmt: skip

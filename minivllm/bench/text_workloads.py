"""Text workloads for `bench serve`: chat requests whose answers do or do not reuse their
prompts, tokenized through the model's own chat template.

- `grounded`: a pasted document and a task whose answer repeats spans of it (copy it, quote
  the sentences about something, edit code and print it whole, summarise with quotations):
  the requests prompt lookup was made for.
- `chat`: open questions with no document, so the answer shares little with the prompt:
  where speculation must cost next to nothing.
- `edit`: a Python file of about 900 tokens and "rename this method, reply with the whole
  file": a long answer that is the prompt's file again, one name changed (the peer
  comparison reads `EDIT_OUTPUT_TOKENS` of it).

The same seed gives the same requests, so every server in a comparison sees the same prompts.
"""

from __future__ import annotations

import random
from typing import Any

DOCUMENTS = [
    """The KV cache is split into fixed-size blocks. Each request owns a block table: the list
of physical blocks that hold its keys and values, in order. The scheduler decides, every step,
which requests run and how many tokens each of them brings; the block manager gives each
request the blocks its plan needs, and takes them back when the request finishes or is
preempted. A block whose tokens are all committed gets a hash of its content and of the blocks
before it, so a later request with the same prefix reuses it instead of computing it again.""",
    """Minutes of the planning meeting, Tuesday 14 March. Present: Ana (chair), Bruno, Chen,
Dalia. The release moves from the 20th to the 27th because the installer still fails on
machines without a network. Bruno will fix the installer by Friday. Chen reported that the
nightly tests take 41 minutes; the goal is under 20, and Dalia will split the slow suite into
its own job. The budget for new test machines was approved. Next meeting: Tuesday 21 March at
ten, in the small room on the second floor.""",
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result""",
    """Our lightweight tent weighs 1.2 kilograms and sleeps two people. The outer shell is
ripstop nylon with a waterproof coating rated at 3000 millimetres, and the floor is rated at
5000. It pitches in about four minutes with a single hubbed pole. There are two doors, two
vestibules and four inside pockets. The tent packs down to 40 by 12 centimetres. It comes with
eight aluminium stakes and a repair kit, and it carries a five-year warranty.""",
    """To bake the bread, mix 500 grams of flour, 350 grams of warm water, 10 grams of salt
and 7 grams of dried yeast in a large bowl. Knead the dough for ten minutes until it is smooth.
Cover it and let it rise for one hour, or until it has doubled in size. Shape it into a loaf,
place it in a tin and let it rise for another thirty minutes. Bake at 220 degrees for thirty
five minutes, until the crust is brown and the loaf sounds hollow when tapped underneath.""",
]

GROUNDED_TASKS = [
    "Repeat the following text exactly, word for word, and nothing else.\n\n{doc}",
    "Quote, word for word, every sentence of the following text that contains a number. "
    "Write one sentence per line.\n\n{doc}",
    "Copy the following text, then add one line at the end that says what it is about.\n\n{doc}",
    "Summarise the following text as a list, quoting its own words wherever you can.\n\n{doc}",
    "Fix any mistakes in the following text and print the whole corrected text.\n\n{doc}",
]

QUESTIONS = [
    "Write a short poem about the sea at night.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me five ideas for a birthday party for a friend who loves hiking.",
    "What are the pros and cons of working from home?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I start learning to play the guitar?",
    "Describe your ideal weekend in a few sentences.",
    "What should I pack for a week-long trip to the mountains?",
]

# A module written for this workload: plain, typical code whose methods the edit renames
EDIT_FILE = '''\
"""A small library loan tracker: members borrow books, return them and pay late fees."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

LOAN_DAYS = 21
DAILY_FEE = 0.25
MAX_LOANS = 5


@dataclass
class Book:
    isbn: str
    title: str
    author: str
    copies: int = 1


@dataclass
class Loan:
    isbn: str
    member_id: int
    borrowed: dt.date
    returned: dt.date | None = None

    def due_date(self) -> dt.date:
        return self.borrowed + dt.timedelta(days=LOAN_DAYS)

    def days_late(self, today: dt.date) -> int:
        end = self.returned or today
        return max(0, (end - self.due_date()).days)


@dataclass
class Member:
    member_id: int
    name: str
    loans: list[Loan] = field(default_factory=list)
    fees_paid: float = 0.0

    def open_loans(self) -> list[Loan]:
        return [loan for loan in self.loans if loan.returned is None]


class Library:
    def __init__(self) -> None:
        self.books: dict[str, Book] = {}
        self.members: dict[int, Member] = {}

    def add_book(self, book: Book) -> None:
        if book.isbn in self.books:
            self.books[book.isbn].copies += book.copies
        else:
            self.books[book.isbn] = book

    def add_member(self, member_id: int, name: str) -> Member:
        if member_id in self.members:
            raise ValueError(f"member {member_id} already exists")
        member = Member(member_id, name)
        self.members[member_id] = member
        return member

    def available_copies(self, isbn: str) -> int:
        book = self.books[isbn]
        on_loan = sum(
            1
            for member in self.members.values()
            for loan in member.open_loans()
            if loan.isbn == isbn
        )
        return book.copies - on_loan

    def borrow(self, member_id: int, isbn: str, today: dt.date) -> Loan:
        member = self.members[member_id]
        if len(member.open_loans()) >= MAX_LOANS:
            raise ValueError(f"{member.name} already has {MAX_LOANS} books")
        if self.outstanding_fees(member_id, today) > 0:
            raise ValueError(f"{member.name} must pay their fees first")
        if self.available_copies(isbn) <= 0:
            raise ValueError(f"no copy of {self.books[isbn].title} is free")
        loan = Loan(isbn, member_id, today)
        member.loans.append(loan)
        return loan

    def give_back(self, member_id: int, isbn: str, today: dt.date) -> Loan:
        member = self.members[member_id]
        for loan in member.open_loans():
            if loan.isbn == isbn:
                loan.returned = today
                return loan
        raise ValueError(f"{member.name} has not borrowed {isbn}")

    def outstanding_fees(self, member_id: int, today: dt.date) -> float:
        member = self.members[member_id]
        owed = sum(loan.days_late(today) * DAILY_FEE for loan in member.loans)
        return round(owed - member.fees_paid, 2)

    def pay(self, member_id: int, amount: float) -> float:
        if amount <= 0:
            raise ValueError("a payment must be positive")
        member = self.members[member_id]
        member.fees_paid += amount
        return member.fees_paid

    def overdue_report(self, today: dt.date) -> list[str]:
        lines = []
        for member in sorted(self.members.values(), key=lambda m: m.name):
            for loan in member.open_loans():
                late = loan.days_late(today)
                if late:
                    title = self.books[loan.isbn].title
                    lines.append(f"{member.name}: {title}, {late} days late")
        return lines
'''

# (method, new name) pairs of EDIT_FILE an edit asks for
EDIT_RENAMES = [
    ("available_copies", "copies_on_shelf"),
    ("outstanding_fees", "fees_owed"),
    ("give_back", "return_book"),
    ("open_loans", "current_loans"),
    ("days_late", "late_days"),
]
EDIT_TASK = (
    "Rename the method `{old}` to `{new}` in the following Python file, and update every "
    "call to it. Reply with the whole updated file and nothing else.\n\n```python\n{doc}```"
)
# How much of the edited file the peer comparison reads per request (docs/real-models.md)
EDIT_OUTPUT_TOKENS = 400

# "random" and "long" are random token ids (long: one stream over 2k and 8k-token prompts)
WORKLOADS = ("random", "long", "grounded", "chat", "edit")
RANDOM_ID_WORKLOADS = ("random", "long")
# The prompt lengths of the long workload's levels, and the tokens each request decodes
LONG_CONTEXTS = (2000, 8000)
LONG_OUTPUT_TOKENS = 256


def text_requests(workload: str, count: int, seed: int) -> list[str]:
    """`count` user messages of the `grounded`, `chat` or `edit` workload, the same for the same
    seed."""
    rng = random.Random(seed)
    if workload == "grounded":
        return [rng.choice(GROUNDED_TASKS).format(doc=rng.choice(DOCUMENTS)) for _ in range(count)]
    if workload == "chat":
        return [rng.choice(QUESTIONS) for _ in range(count)]
    if workload == "edit":
        # every rename once before any again: repeated prompts would time prefix caching
        order = rng.sample(EDIT_RENAMES, len(EDIT_RENAMES))
        renames = [order[i % len(order)] for i in range(count)]
        return [EDIT_TASK.format(old=old, new=new, doc=EDIT_FILE) for old, new in renames]
    raise ValueError(f"unknown text workload {workload!r}; known: grounded, chat, edit")


def text_prompts(tokenizer: Any, workload: str, count: int, seed: int) -> list[list[int]]:
    """`text_requests` as prompt token ids through the tokenizer's chat template."""
    from minivllm.engine.requests import chat_prompt

    return [
        chat_prompt(tokenizer, [{"role": "user", "content": message}], add_generation_prompt=True)
        for message in text_requests(workload, count, seed)
    ]


def bench_tokenizer(model: str | None) -> Any:
    """The tokenizer of a model path as the engine reads it (a .gguf file or an HF
    directory; None: the default model)."""
    from pathlib import Path

    from minivllm.models.gguf import build_tokenizer
    from minivllm.models.paths import default_model_path
    from minivllm.tokenizer import load_tokenizer

    path = Path(model or default_model_path()).expanduser()
    return build_tokenizer(path) if path.suffix.lower() == ".gguf" else load_tokenizer(path)

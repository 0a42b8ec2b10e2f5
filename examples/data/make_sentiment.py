"""Build ``sentiment_train.csv`` and ``sentiment_validation.csv``: the embedded SST-2-style set.

Written for hf-memwatch (not drawn from SST-2): hand-written opinion clauses about films, books,
records, games, meals and gadgets, composed with neutral openers. Validation sentences use clauses
that never occur in training, so its accuracy measures generalisation, not memory. Deterministic:

    .venv/bin/python examples/data/make_sentiment.py
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

SUBJECTS = [
    "the film",
    "this movie",
    "the novel",
    "the album",
    "the sequel",
    "the documentary",
    "this game",
    "the play",
    "the restaurant",
    "the new phone",
    "the series finale",
    "the concert",
    "this book",
    "the cafe",
    "the museum tour",
    "the animated short",
    "the podcast",
    "the musical",
    "the hotel",
    "the comedy special",
]

POSITIVE = [
    "is a delight from start to finish",
    "left me grinning for hours",
    "has a warm heart and a sharp wit",
    "is beautifully shot and tenderly acted",
    "rewards every minute you give it",
    "is the best thing I have seen all year",
    "feels fresh, clever and alive",
    "made the whole family laugh out loud",
    "kept me hooked until the very last page",
    "sings with real joy",
    "is a genuine pleasure to sit through",
    "moved me more than I expected",
    "is smart, funny and surprisingly wise",
    "deserves every award it gets",
    "won me over in the first five minutes",
    "is gorgeous to look at and easy to love",
    "is a small masterpiece",
    "brims with charm and invention",
    "is worth every penny",
    "has a soundtrack I keep humming",
    "lifted my mood on a grey afternoon",
    "is thoughtful, generous and kind",
    "is an absolute triumph",
    "delivers thrills with a light touch",
    "gets better every time I return to it",
    "is crafted with obvious love",
    "surprised me with its grace",
    "is tightly written and wonderfully paced",
    "made me want to call my friends right away",
    "glows with confidence",
    "is a real crowd pleaser",
    "earns its happy ending",
    "is exciting, inventive and fun",
    "is a treat for anyone who loves stories",
    "stays with you in the best way",
    "is warm, witty and wise",
    "has performances that shine",
    "is pure fun from the opening scene",
    "is the most satisfying hour of my week",
    "felt like a gift",
    "is elegant and full of life",
    "made me fall in love with the genre again",
    "has a wonderful sense of humour",
    "is a joy to recommend",
    "handles its big emotions with care",
    "is bright, bold and brilliant",
    "never once lost my attention",
    "is lovely in every detail",
    "has a clever script and a big heart",
    "is easily the highlight of the season",
    "is fantastic and I would go again tomorrow",
    "had me cheering at the end",
    "is moving without being sentimental",
    "is excellent value and a pleasure to use",
    "is charming, quick and delightful",
    "nails every scene it attempts",
    "is inspiring and beautifully made",
    "is an easy favourite",
    "is refreshing and honest",
    "is superb",
    "has the kindest staff I have met",
    "is a rich and rewarding experience",
    "made the long trip worth it",
    "is cheerful, tasty and generous",
    "is a stunning achievement",
    "is playful and smart in equal measure",
    "turns a simple idea into something magical",
    "is delicious from the first bite",
    "is confident, stylish and great fun",
    "is a wonderful surprise",
]

NEGATIVE = [
    "is a tedious slog from start to finish",
    "left me bored and irritated",
    "has no heart and even less wit",
    "is ugly to look at and stiffly acted",
    "wastes every minute you give it",
    "is the worst thing I have seen all year",
    "feels stale, lazy and lifeless",
    "made the whole family groan",
    "lost me long before the last page",
    "falls flat at every turn",
    "is a chore to sit through",
    "left me cold and annoyed",
    "is dull, clumsy and oddly smug",
    "deserves to be forgotten",
    "lost me in the first five minutes",
    "is a mess that nobody could love",
    "is a complete disaster",
    "is drained of charm and ideas",
    "is a waste of money",
    "has a soundtrack that grates on the nerves",
    "ruined a perfectly good evening",
    "is shallow, cynical and mean",
    "is an embarrassing failure",
    "has no thrills and no pulse",
    "gets worse every time I think about it",
    "feels cheap and careless",
    "disappointed me at every step",
    "is badly written and painfully slow",
    "made me want to leave early",
    "reeks of desperation",
    "is a real letdown",
    "has an ending that makes no sense",
    "is boring, predictable and silly",
    "is a punishment for anyone who loves stories",
    "is instantly forgettable",
    "is cold, clumsy and dreary",
    "has performances that fall apart",
    "is a drag from the opening scene",
    "is the most frustrating hour of my week",
    "felt like a chore",
    "is sloppy and lifeless",
    "made me give up on the genre",
    "has jokes that never land",
    "is impossible to recommend",
    "handles its big emotions with a sledgehammer",
    "is dim, drab and dreadful",
    "lost my attention almost immediately",
    "is careless in every detail",
    "has a lazy script and no heart",
    "is easily the low point of the season",
    "is awful and I would never go again",
    "had me checking my watch",
    "is mawkish and manipulative",
    "is poor value and a pain to use",
    "is charmless, slow and grim",
    "botches every scene it attempts",
    "is depressing and badly made",
    "is an easy skip",
    "is hollow and dishonest",
    "is terrible",
    "has the rudest staff I have met",
    "is a thin and joyless experience",
    "made the long trip a waste",
    "is greasy, bland and overpriced",
    "is a staggering misfire",
    "is smug and stupid in equal measure",
    "turns a promising idea into something tiresome",
    "is inedible from the first bite",
    "is muddled, flat and no fun at all",
    "is a horrible surprise",
]

OPENERS = [
    "",
    "Honestly, ",
    "In the end, ",
    "I have to say ",
    "Frankly, ",
    "To be fair, ",
    "My verdict: ",
    "After a second look, ",
    "Believe me, ",
    "Put simply, ",
]

HELD_OUT_EVERY = 5  # every fifth clause of each polarity is validation-only


def sentence(rng: random.Random, clause: str) -> str:
    """One opinion sentence: an opener, a subject and the clause."""
    opener = rng.choice(OPENERS)
    subject = rng.choice(SUBJECTS)
    text = f"{opener}{subject} {clause}."
    return text[0].upper() + text[1:]


def build(rng: random.Random, clauses: list[str], label: int, per_clause: int) -> list[tuple[str, int]]:
    """``per_clause`` distinct sentences for each clause."""
    rows: set[tuple[str, int]] = set()
    for clause in clauses:
        made = 0
        while made < per_clause:
            row = (sentence(rng, clause), label)
            if row not in rows:
                rows.add(row)
                made += 1
    return sorted(rows)


def split(clauses: list[str]) -> tuple[list[str], list[str]]:
    """Training clauses and held-out validation clauses."""
    validation = clauses[::HELD_OUT_EVERY]
    return [c for c in clauses if c not in validation], validation


def write(path: Path, rows: list[tuple[str, int]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["idx", "sentence", "label"])
        for idx, (text, label) in enumerate(rows):
            writer.writerow([idx, text, label])


def main() -> None:
    rng = random.Random(20261129)
    pos_train, pos_val = split(POSITIVE)
    neg_train, neg_val = split(NEGATIVE)
    train = build(rng, pos_train, 1, 5) + build(rng, neg_train, 0, 5)
    validation = build(rng, pos_val, 1, 6) + build(rng, neg_val, 0, 6)
    rng.shuffle(train)
    rng.shuffle(validation)
    here = Path(__file__).parent
    write(here / "sentiment_train.csv", train)
    write(here / "sentiment_validation.csv", validation)
    print(f"train {len(train)} rows, validation {len(validation)} rows")


if __name__ == "__main__":
    main()

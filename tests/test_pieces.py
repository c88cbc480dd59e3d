"""Long text: pieces of at most ~20 s of speech and their token budgets (no model)."""

from __future__ import annotations

from mlx_chatterbox.generation.pieces import PIECE_LENGTH, split_pieces, spoken_length, token_budget
from mlx_chatterbox.sampling import SamplingParams

# A 1,500-character chapter: about 100 s of speech at the ~15 characters a second of read English.
CHAPTER = " ".join(
    [
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father",
        "had taught him. There were one hundred and twelve of them, worn smooth in the middle by a century of",
        "boots. At the top he trimmed the wick, polished the great lens, and watched the ships slide past the",
        "headland like slow grey whales. Some nights the fog rolled in so thick that he could not see his own",
        "hand, and then he wound the horn and let it call out across the water every thirty seconds until dawn.",
        "He kept a log of everything: the wind, the weather, the names of the vessels, the hour each one passed.",
        "In 1911 a storm tore the roof from the keeper's cottage and flooded the oil store, yet the light never",
        "went out. His daughter, who was nine that winter, carried cans of oil up the stairs two at a time while",
        "he held the lamp steady against the gale. Years later she would become the keeper herself, the first",
        "woman on that coast to hold the post, and she kept the same log in the same careful hand. When the",
        "light was finally automated, an engineer from the city came to fit the new machinery. He asked her",
        "whether she would miss the climb. She laughed and said that the stairs had always been the easy part;",
        "it was the waiting that took a lifetime to learn. Then she handed him the keys, walked down the path to",
        "the village, and did not look back, though everyone who saw her that day swore she was smiling.",
    ]
)


def test_a_chapter_is_split_into_sentence_packed_pieces_that_fit_their_budgets():
    assert 1400 <= len(CHAPTER) <= 1600
    pieces = split_pieces(CHAPTER, lambda piece: True)
    assert " ".join(pieces).split() == CHAPTER.split()
    assert len(pieces) >= 5 and all(spoken_length(p) <= PIECE_LENGTH for p in pieces)
    assert all(p.endswith((".", ";", "!", "?")) for p in pieces[:-1])  # whole sentences where they fit
    budgets = [token_budget(p) for p in pieces]
    # Every piece's budget fits in upstream's default of 1000 tokens, and together they cover the chapter read at
    # half the usual pace: ~100 s (2500 tokens) at the usual one, where one pass stopped at 1000 tokens (40 s).
    assert max(budgets) <= SamplingParams().max_new_tokens
    assert sum(budgets) >= 1.8 * 100 * 25


def test_budgets():
    assert spoken_length("In 1999.") == len("In 1999.") + 3 * 4  # a digit counts as four characters
    assert token_budget("Hi.") == 60  # 25 x (2 s + 3 / 8 s), rounded up
    # The longest piece, letters or digits, still fits in upstream's default max_new_tokens.
    assert token_budget("a" * PIECE_LENGTH) == token_budget("1" * (PIECE_LENGTH // 4)) == 988
    assert token_budget("Hello there, how are you?") < token_budget(
        "Hello there, how are you today, my friend?"
    )


def test_a_sentence_longer_than_a_piece_is_cut_at_clauses_then_words():
    sentence = ", ".join(["a clause of several words"] * 20) + "."
    pieces = split_pieces(sentence, lambda piece: True)
    assert len(pieces) > 1 and all(spoken_length(p) <= PIECE_LENGTH for p in pieces)
    assert all(p.endswith(",") for p in pieces[:-1])
    words = " ".join(["word"] * 100)  # no punctuation at all
    assert all(spoken_length(p) <= PIECE_LENGTH for p in split_pieces(words, lambda piece: True))

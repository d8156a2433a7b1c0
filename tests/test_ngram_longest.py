"""drafts/ngram.py: a chain's continuation and walk by their shortcuts (`_longest`,
`_chain_walk`) are exactly what ranking every candidate and walking the tree gave."""

import random

from drafts.ngram import _chain, _chain_walk, _RequestIndex, _walk


def _index(rng, n: int, vocab: int, windows=(1, 12)) -> _RequestIndex:
    index = _RequestIndex(*windows)
    index.extend([rng.randrange(vocab) for _ in range(n)])
    return index


def test_a_chains_continuation_is_the_first_of_the_ranked_ones():
    rng = random.Random(0)
    checked = found = 0
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        windows = rng.choice([(1, 12), (2, 4), (3, 12)])
        index = _index(rng, rng.randrange(2, 300), vocab, windows)
        for context in rng.sample(range(1, len(index.ids) + 1), min(8, len(index.ids))):
            length = rng.randrange(1, 9)
            ranked = index.continuations(length, 2, context)  # the ranking path
            assert index.continuations(length, 1, context) == ranked[:1], (trial, context)
            checked, found = checked + 1, found + bool(ranked)
    assert checked > 1000 and 0 < found < checked  # both a match and none were met


def test_the_max_window_stops_the_look_at_the_most_recent_longest_match():
    index = _RequestIndex(1, 3)
    # "1 2 3" occurs at 0 and 4 with different continuations (4, then 5); the query ends "1 2 3"
    index.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    assert index.continuations(2, 1) == [[5, 1]]


def test_a_chain_walk_is_the_tree_walk_of_a_chain():
    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randrange(2, 10)
        conts = [[rng.randrange(3) for _ in range(rng.randrange(0, n))]]
        tokens, parents = _chain(conts, n)
        tokens = [0 if t is None else t for t in tokens]
        actual = [rng.randrange(3) for _ in range(n - 1)]
        assert _chain_walk(tokens, actual) == _walk(tokens, parents, actual)

"""benchmarks/padding.py counts the tokens a micro-batch computes (every row padded to the chunk's longest)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "padding", Path(__file__).resolve().parent.parent / "benchmarks" / "padding.py")
padding = importlib.util.module_from_spec(spec)
spec.loader.exec_module(padding)


def test_padded_tokens_pad_each_chunk_to_its_longest_row():
    lengths = [10, 2, 9, 3]
    assert padding.padded_tokens(lengths, [[0, 1], [2, 3]]) == 2 * 10 + 2 * 9
    sampled = padding.example_chunks([0, 1, 2, 3], lengths, 2, sort=False)
    shortest = padding.example_chunks([0, 1, 2, 3], lengths, 2, sort=True)
    assert sampled == [[0, 1], [2, 3]] and shortest == [[1, 3], [2, 0]]
    assert padding.padded_tokens(lengths, shortest) == 2 * 3 + 2 * 10 < padding.padded_tokens(lengths, sampled)


def test_user_chunks_keep_each_user_whole_in_either_order():
    lengths = [10, 2, 9, 3, 8]
    indices, users = [0, 1, 2, 3, 4], [0, 1, 0, 2, 1]
    for sort in (False, True):
        chunks = padding.user_chunks(indices, users, lengths, 2, sort)
        assert sorted(i for chunk in chunks for i in chunk) == indices
        for chunk in chunks:  # a user's rows are all in one chunk
            assert all(users[j] not in {users[i] for i in chunk} for other in chunks if other is not chunk
                       for j in other)

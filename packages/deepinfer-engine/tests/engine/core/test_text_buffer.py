import random

from deepinfer.engine.core.text_buffer import TextBuffer


def test_text_buffer_matches_a_plain_string_under_random_edits():
    rng = random.Random(0)
    buf, plain = TextBuffer(), ""
    for _ in range(3000):
        op = rng.random()
        if op < 0.6:
            piece = "".join(rng.choice("abcé日😀") for _ in range(rng.randint(0, 5)))
            buf.append(piece)
            plain += piece
        elif op < 0.8:
            n = rng.randint(0, 12)
            assert buf.tail(n) == (plain[-n:] if n else "")
        elif op < 0.95:
            keep = rng.randint(max(0, len(plain) - 10), len(plain))
            buf.truncate(keep)
            plain = plain[:keep]
        else:
            assert buf.text() == plain
        assert buf.length == len(plain)
    assert buf.text() == plain

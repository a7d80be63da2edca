"""IncrementalDetokenizer: incremental text equals a full decode; stop strings never leak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from prefixserve.core.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(others)},
    }


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: token id == byte value, EOS is id 256."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def _tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """The byte-level tokenizer, and the built-in model's tokenizer where it exists."""
    tokenizers = {"byte": byte_tokenizer()}
    try:
        from prefixserve.models.builtin import builtin_tokenizer
    except ImportError:
        return tokenizers
    return {**tokenizers, "builtin": builtin_tokenizer()}


TOK = byte_tokenizer()
TOKENIZERS = _tokenizers()


def encode(text: str, tokenizer: PreTrainedTokenizerFast = TOK) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed ``ids`` ``chunk`` at a time; return the deltas seen (what ``output_text`` gained, as
    the server streams it) and the matched stop string."""
    deltas: list[str] = []

    def read() -> None:
        sent = "".join(deltas)
        assert detok.output_text.startswith(sent)  # released text is never taken back
        deltas.append(detok.output_text[len(sent) :])

    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        read()
        if stop is not None:
            return deltas, stop
    detok.flush()
    read()
    return deltas, None


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Char-by-char: the first stop string to complete (ties: the longest) cuts the text."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


@pytest.mark.parametrize("tokenizer", TOKENIZERS.values(), ids=TOKENIZERS.keys())
@given(data=st.data(), chunk=st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_incremental_equals_full_decode_random_ids(
    tokenizer: PreTrainedTokenizerFast, data: st.DataObject, chunk: int
) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=60))
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=skip)
        deltas, stop = stream(detok, ids, chunk)
        assert stop is None
        expected = tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
        assert "".join(deltas) == detok.output_text == expected


@pytest.mark.parametrize("tokenizer", TOKENIZERS.values(), ids=TOKENIZERS.keys())
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
@settings(max_examples=100, deadline=None)
def test_incremental_equals_full_decode_text(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = encode(text, tokenizer)
    detok = IncrementalDetokenizer(tokenizer, [], [])
    stream(detok, ids)
    assert detok.output_text == tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def test_prompt_text_is_not_in_output() -> None:
    detok = IncrementalDetokenizer(TOK, encode("The prompt says: "), [])
    stream(detok, encode("an answer"))
    assert detok.output_text == "an answer"


def test_multibyte_char_split_across_tokens_never_emits_replacement_char() -> None:
    text = "héllo € 😀 世界!"
    detok = IncrementalDetokenizer(TOK, encode("prompt ✓"), [])
    for token_id in encode(text):
        assert detok.update([token_id]) is None
        assert "\ufffd" not in detok.output_text and text.startswith(detok.output_text)
    detok.flush()
    assert detok.output_text == text


def test_flush_releases_incomplete_char_and_held_back_text() -> None:
    ids = encode("ok STO") + encode("€")[:2]
    detok = IncrementalDetokenizer(TOK, [], ["STOP"])
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == "ok "  # "STO" may start "STOP"; the € is unfinished
    assert detok.flush() is None
    assert detok.output_text == "ok STO\ufffd" == TOK.decode(ids)


def test_stop_string_across_tokens_never_leaks() -> None:
    text = "Hello world. STOP here and more"
    detok = IncrementalDetokenizer(TOK, [], ["STOP"])
    deltas, stop = stream(detok, encode(text))
    assert stop == "STOP" == detok.stop_reason
    assert detok.output_text == "".join(deltas) == "Hello world. "
    assert all("S" not in d for d in deltas)


def test_include_stop_str_in_output() -> None:
    detok = IncrementalDetokenizer(TOK, [], ["</answer>"], include_stop_str_in_output=True)
    deltas, stop = stream(detok, encode("42</answer> trailing"), chunk=3)
    assert stop == "</answer>"
    assert detok.output_text == "".join(deltas) == "42</answer>"


def test_multiple_stop_strings_earliest_wins() -> None:
    detok = IncrementalDetokenizer(TOK, [], ["world", "lo w", "xyz"])
    stream(detok, encode("hello world xyz"), chunk=5)
    assert detok.stop_reason == "lo w"
    assert detok.output_text == "hel"


def test_stop_string_in_one_update_matches_token_by_token() -> None:
    """Whatever the chunking, the stop string that completes first in the text wins."""
    stops = ["abcd", "bc"]
    for chunk in (1, 2, 4, 10):
        detok = IncrementalDetokenizer(TOK, [], stops)
        stream(detok, encode("xabcdy"), chunk)
        assert (detok.output_text, detok.stop_reason) == ("xa", "bc")


def test_stop_string_made_of_multibyte_chars() -> None:
    detok = IncrementalDetokenizer(TOK, [], ["€€"])
    deltas, stop = stream(detok, encode("price: 5€ or 6€€ ok"))
    assert stop == "€€"
    assert detok.output_text == "price: 5€ or 6"
    assert all("\ufffd" not in d for d in deltas)


def test_skip_special_tokens() -> None:
    ids = [*encode("hi"), TOK.eos_token_id, *encode(" yo")]
    for skip, expected in ((True, "hi yo"), (False, f"hi{EOS} yo")):
        detok = IncrementalDetokenizer(TOK, [], [], skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == detok.output_text == expected


def test_stop_string_spanning_special_token_when_not_skipped() -> None:
    ids = [*encode("a"), TOK.eos_token_id, *encode("b")]
    detok = IncrementalDetokenizer(TOK, [], ["|>b"], skip_special_tokens=False)
    _, stop = stream(detok, ids)
    assert stop == "|>b"
    assert detok.output_text == "a<|endoftext"


@given(
    text=st.text(alphabet="ab€ ", max_size=30),
    stops=st.lists(st.text(alphabet="ab€ ", min_size=1, max_size=4), max_size=3),
    chunk=st.integers(1, 5),
    include=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_stop_strings_property(text: str, stops: list[str], chunk: int, include: bool) -> None:
    expected, expected_stop = reference_stop(text, stops, include)
    detok = IncrementalDetokenizer(TOK, [], stops, include_stop_str_in_output=include)
    ids = encode(text)
    stop = None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk])
        # Every released prefix is final text: no partial stop string, no replacement char.
        assert expected.startswith(detok.output_text)
        if stop is not None:
            break
    if stop is None:
        assert detok.flush() is None
    assert stop == expected_stop == detok.stop_reason
    assert detok.output_text == expected

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.batch import IGNORE_INDEX
from trainer.config import ModelConfig
from trainer.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, decode, encode


def test_ids_are_bytes_then_specials():
    assert (BOS, EOS, PAD, VOCAB_SIZE) == (256, 257, 258, 259)
    assert VOCAB_SIZE <= ModelConfig().vocab_size
    ids = encode("Aé")
    assert ids.dtype == np.int32
    assert ids.tolist() == [65, 0xC3, 0xA9]


def test_round_trip_text_and_bytes():
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓ 🚀\n"
    assert decode(encode(text)) == text
    assert decode(encode(text.encode("utf-8"))) == text
    assert decode(encode("")) == ""


def test_bos_eos_framing_and_specials_rendering():
    ids = encode("12+7=19\n", bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and len(ids) == 10
    assert decode(ids) == "12+7=19\n"
    assert decode(ids, specials=True) == "<bos>12+7=19\n<eos>"


def test_decode_drops_ignore_index_and_padded_vocab_ids():
    targets = torch.tensor([104, 105, PAD, IGNORE_INDEX, 300, 33])
    assert decode(targets) == "hi!"
    assert decode(targets, specials=True) == "hi<pad>!"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    ids = encode(text, bos=True, eos=True)
    assert ids.min() >= 0 and ids.max() < VOCAB_SIZE
    assert decode(ids) == text

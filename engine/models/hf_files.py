"""The files of a Hugging Face model directory beside its config and weights that a derived model (a draft cut from
its target, a random draft over its tokenizer) copies: its tokenizer, generation defaults and chat template."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def copy_tokenizer_files(src, out) -> None:
    """Each of TOKENIZER_FILES that ``src`` (a directory) has, copied into ``out``."""
    import shutil
    from pathlib import Path

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(out) / name)

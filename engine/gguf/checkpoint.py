"""A GGUF file as a checkpoint directory the rest of the engine can read.

Everything the engine reads by path (config.json, generation_config.json, the tokenizer files
with the chat template) is derived from the file once, written under $ENGINE_HOME/gguf/ in a
directory named by the file's content hash, and renamed into place whole, so concurrent starters
never see half of one. The weights are not copied: the directory's `model.gguf` links to the file,
and the loader reads and dequantizes its tensors at each start (engine/gguf/weights.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from engine.gguf.hf_config import generation_config, hf_config
from engine.gguf.hf_tokenizer import write_tokenizer
from engine.gguf.metadata import GGUFError
from engine.gguf.reader import GGUFFile, read_gguf
from engine.settings.home import build_directory

log = logging.getLogger(__name__)

WEIGHTS_LINK = "model.gguf"
# Bump when what is derived from a file changes, so old directories are not reused.
FORMAT_VERSION = 2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file a model path names: the file itself, or the one .gguf in a directory that is
    no Hugging Face checkpoint (no config.json); None for anything else."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise GGUFError(f"{path} holds several GGUF files ({names}): name the one to serve")
    return None


def prepare_checkpoint(gguf_path: Path, home: Path, tokenizer_dir: Path | None = None) -> Path:
    """The checkpoint directory for `gguf_path` (its tokenizer from `tokenizer_dir` when given),
    derived now unless this engine home has it already."""
    gguf_path = gguf_path.resolve()
    key = _content_hash(gguf_path, home / "gguf" / "hashes")
    if tokenizer_dir is not None:
        key += "-tok" + _tokenizer_hash(tokenizer_dir)
    target = home / "gguf" / f"{key}-v{FORMAT_VERSION}"
    if not (target / "config.json").is_file():
        _derive(gguf_path, target, tokenizer_dir)
    _link_weights(target, gguf_path)
    return target


def _derive(gguf_path: Path, target: Path, tokenizer_dir: Path | None) -> None:
    def derive(staging: Path) -> None:
        with read_gguf(gguf_path) as gguf:  # a file it cannot read fails in one line, unlogged
            log.info("writing %s's config and tokenizer (once) into %s", gguf_path.name, target)
            write_hf_files(gguf, staging, tokenizer_dir)

    build_directory(target, derive, "config.json")


def write_hf_files(gguf: GGUFFile, out: Path, tokenizer_dir: Path | None = None) -> None:
    """config.json, generation_config.json and the tokenizer files (with the chat template) of
    the file's model into `out`; the tokenizer's from `tokenizer_dir` when one is given."""
    (out / "config.json").write_text(json.dumps(hf_config(gguf), indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(gguf), indent=2))
    if tokenizer_dir is None:
        write_tokenizer(gguf, out)
    else:
        _copy_tokenizer(tokenizer_dir, out)


def _link_weights(target: Path, gguf_path: Path) -> None:
    """Point the directory's weights at the file (the same content may have moved)."""
    link = target / WEIGHTS_LINK
    if link.is_symlink() and link.resolve() == gguf_path:
        return
    temporary = target / f".{WEIGHTS_LINK}.{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(gguf_path)
    os.replace(temporary, link)  # atomic: a concurrent reader sees the old link or the new


def _copy_tokenizer(source: Path, staging: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer_config.json" not in copied:
        raise GGUFError(f"--tokenizer {source}: no tokenizer.json or tokenizer_config.json there")
    for name in copied:
        shutil.copyfile(source / name, staging / name)


def _content_hash(path: Path, memo_dir: Path) -> str:
    """The file's content hash, read from a memo while the file's size, modification time and
    inode are those it was computed for (as git's index does): hashing reads the whole file,
    which every start would pay again, and a multi-GB model file takes seconds."""
    stat = path.stat()
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}"
    memo = memo_dir / hashlib.sha256(identity.encode()).hexdigest()[:24]
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    content = digest.hexdigest()[:20]
    memo_dir.mkdir(parents=True, exist_ok=True)
    temporary = memo.with_name(f".{memo.name}.{os.getpid()}")
    temporary.write_text(content)
    os.replace(temporary, memo)
    return content


def _tokenizer_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = directory / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:12]

"""Where `serve-mlx`'s models come from: `NAME=PATH`, a local folder or a Hugging Face repo.

A model is given as `PATH` or `NAME=PATH`. PATH is a local mlx-lm model folder (one with
a `config.json`) or a Hugging Face repo id (`mlx-community/Qwen3-0.6B-4bit`), which is
resolved **offline** from the Hugging Face cache (`huggingface_hub.snapshot_download`
with `local_files_only=True`: the cache's `refs/main` snapshot); nothing is ever
downloaded here. NAME is what requests send as `model` and what the ledger row is
called (`serve-mlx/NAME`); without one it is the folder's name, or the repo's (the part
after the slash). The full spelling a user gave (the path, the repo id) is accepted as
`model` too, since that is what mlx_lm.server's clients send.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvcached.errors import InvalidArgument

#: A name a request can send and a ledger row can carry (no '/': a repo id has one).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$")
#: `owner/name`, as the Hub spells repo ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelSource:
    """One model to serve: its name, its folder, and how the user spelled it."""

    name: str
    path: Path
    given: str


def hf_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face hub cache searched for repo ids (HF_HUB_CACHE, HF_HOME, else
    ~/.cache/huggingface/hub, as huggingface_hub reads them)."""
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def parse_source(spec: str, cache_dir: str | Path | None = None) -> ModelSource:
    """The model `spec` (`PATH` or `NAME=PATH`) names; InvalidArgument saying where it
    looked when there is none."""
    name: str | None = None
    location = spec
    head, sep, tail = spec.partition("=")
    if sep and _NAME.match(head) and tail:
        name, location = head, tail
    path = Path(location).expanduser()
    if path.exists():
        folder = path
    elif _REPO_ID.match(location):
        folder = _from_hf_cache(location, cache_dir)
    else:
        raise InvalidArgument(
            f"model {spec!r}: no folder {str(path)!r}, and {location!r} is not a Hugging "
            "Face repo id (owner/name); pass a model folder, a repo id in the Hugging Face "
            "cache, or NAME=either"
        )
    if not (folder / "config.json").is_file():
        raise InvalidArgument(
            f"{str(folder)!r} is not an mlx-lm model folder (no config.json); pass local "
            "model folders or repo ids in the Hugging Face cache"
        )
    if name is None:
        name = location.rstrip("/").split("/")[-1] if folder != path else path.resolve().name
    if not _NAME.match(name):
        raise InvalidArgument(
            f"model name {name!r} (from {spec!r}) has characters a request cannot send; "
            "give one with NAME=PATH (letters, digits, '._:@+-')"
        )
    return ModelSource(name, folder, location)


def _from_hf_cache(repo_id: str, cache_dir: str | Path | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_cache_dir(cache_dir)
    try:
        folder = snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise InvalidArgument(
            f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and is not a "
            f"local folder; nothing is downloaded here: fetch it first (`hf download "
            f"{repo_id}`, or set HF_HUB_CACHE to the cache that holds it) or pass its folder"
        ) from None
    return Path(str(folder))

"""Hugging Face Hub ids (`--model Qwen/Qwen2.5-7B`): the repository's config.json, and only it.

Read through `huggingface_hub` (the `hub` extra), from the local Hugging Face cache first
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`; the cache's own
layout, models--org--name/snapshots/<revision>/config.json with refs/main naming the
revision). Only when the cache lacks it, and `HF_HUB_OFFLINE` is not set, is config.json
downloaded, with `HF_TOKEN` for gated repositories. Nothing else is fetched and no code from
the repository runs: the file is parsed as JSON and mapped by vramcalc.hf_config (which
ignores `auto_map`).

Pure apart from the cache and the download; the environment is read at each call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vramcalc.errors import InputError

# org/name as the Hub spells repository ids (letters, digits, '-', '_', '.'; at most 96 each)
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}$")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_hub_id(text: str) -> bool:
    """`org/name`: one slash, the Hub's characters, no `..`."""
    return bool(HUB_ID.match(text)) and ".." not in text


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder, from the environment as huggingface_hub reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_config_path(repo_id: str) -> Path:
    """The local path of `repo_id`'s config.json: from the cache, else downloaded (unless
    HF_HUB_OFFLINE). InputError when it cannot be had, saying why."""
    try:  # the hub extra, loaded only for Hub ids
        from huggingface_hub import (
            errors,
            get_hf_file_metadata,
            hf_hub_download,
            hf_hub_url,
            try_to_load_from_cache,
        )
    except ImportError:
        raise InputError(f"{repo_id}: reading a Hugging Face Hub id needs huggingface_hub: "
                         "pip install 'llm-vramcalc[hub]' (or pass a local config.json)"
                         ) from None
    cache = hub_cache_dir()
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(cached, str):
        return Path(cached)
    if offline():
        raise InputError(f"{repo_id}: config.json is not in the Hugging Face cache ({cache}) "
                         "and HF_HUB_OFFLINE is set")
    token = os.environ.get("HF_TOKEN") or None
    try:  # one HEAD request first, without retries: a clear answer fast when offline
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), token=token)
        path = hf_hub_download(repo_id, "config.json", cache_dir=cache, token=token)
    except errors.GatedRepoError:
        raise InputError(f"{repo_id}: gated repository; accept its licence on "
                         "huggingface.co and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such model on the Hugging Face Hub (or it is "
                         "private: set HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError:  # no connection and not cached
        raise InputError(f"{repo_id}: config.json is not in the Hugging Face cache ({cache}) "
                         "and the Hub cannot be reached") from None
    except errors.EntryNotFoundError:
        raise InputError(f"{repo_id}: the repository has no config.json") from None
    except Exception as err:  # network errors: the HTTP client's own exception types
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        raise InputError(f"{repo_id}: config.json is not in the Hugging Face cache ({cache}) "
                         f"and the Hub cannot be reached ({reason})") from None
    return Path(str(path))

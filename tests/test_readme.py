"""The README and the docs run as written: every bash/python block is marked, the marked ones run, links resolve.

A README drifts silently: a renamed option, a snippet that was never complete, a link to a file outside
the repository. So do docs. This harness makes the suite catch all three in `README.md` and every
`docs/*.md`. The convention (also in docs/contributing.md): every fenced ```bash or ```python block
carries an HTML comment on the line before its fence (or two lines before, with one blank line between):

    <!-- readme-test: run -->                           run it as written
    <!-- readme-test: run args="--games 7" -->          append these arguments to every `python -m` line
    <!-- readme-test: run slow timeout=900 -->          a slow block (pytest.mark.slow), its own time limit
    <!-- readme-test: run make_args="ARENA_ARGS='--games 7'" -->   appended to every `make` line
    <!-- readme-test: skip reason="needs a GPU cluster" -->        never run; the reason is required

Python blocks run as a script with the repository's venv interpreter. In a bash block only the commands
that start with `.venv/bin/python -m diprl.` or `make ` run (curl against a server, `ray up`, ... need
something the suite cannot provide; a block with nothing runnable must be marked skip). Blocks in other
languages (yaml, text, a bare fence for printed output) are not run and may not carry a marker.
Everything runs in the repository root with the Makefile's offline environment. Each block is its own
test, named by file and fence line (`README.md:123`, `docs/cluster.md:117`). The docs site itself is
built by tests/test_docs.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

BASH_LANGS = frozenset({"bash", "sh", "shell"})
PYTHON_LANGS = frozenset({"python", "py"})
RUNNABLE_PREFIXES = (".venv/bin/python -m diprl.", "make ")
DEFAULT_TIMEOUT_S = 120.0
SLOW_TIMEOUT_S = 600.0
OUTPUT_TAIL = 4000

MARKER_RE = re.compile(r"^\s*<!--\s*readme-test:(?P<body>.*?)-->\s*$")
FENCE_RE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
# [text](target "title") and ![alt](target); reference definitions [id]: target; <img src="target">.
INLINE_LINK_RE = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$")
HTML_SRC_RE = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href)=\"(?P<target>[^\"]+)\"", re.IGNORECASE)
EXTERNAL_RE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.IGNORECASE)


class MarkerError(ValueError):
    """A `readme-test` comment that cannot be read: an unknown action or attribute, a missing reason."""


@dataclass(frozen=True)
class Marker:
    """What the harness does with one block."""

    action: str  # "run" or "skip"
    args: str = ""  # appended to every `python -m` line of a bash block
    make_args: str = ""  # appended to every `make` line of a bash block
    slow: bool = False
    timeout_s: float | None = None
    reason: str = ""

    @property
    def timeout(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return SLOW_TIMEOUT_S if self.slow else DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its code, where its fence starts, and its marker if any."""

    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: Marker | None = None
    marker_error: str | None = None

    @property
    def kind(self) -> str | None:
        if self.lang in BASH_LANGS:
            return "bash"
        if self.lang in PYTHON_LANGS:
            return "python"
        return None

    @property
    def test_id(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Extraction:
    """Every block of a markdown file, plus markers that sit on no block (moved or orphaned)."""

    path: str = "README.md"
    blocks: list[Block] = field(default_factory=list)
    orphan_markers: list[int] = field(default_factory=list)  # 1-based lines

    @property
    def checked(self) -> list[Block]:
        return [b for b in self.blocks if b.kind is not None]


def parse_marker(text: str) -> Marker | None:
    """The marker on one line, None when the line is not a `readme-test` comment."""
    match = MARKER_RE.match(text)
    if match is None:
        return None
    try:
        tokens = shlex.split(match.group("body"))
    except ValueError as exc:
        raise MarkerError(f"unreadable readme-test marker {text.strip()!r}: {exc}") from exc
    if not tokens or tokens[0] not in ("run", "skip"):
        raise MarkerError(f"readme-test marker must start with run or skip: {text.strip()!r}")
    action, values = tokens[0], {}
    flags: set[str] = set()
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        if sep:
            values[key] = value
        else:
            flags.add(key)
    allowed_values = {"run": {"args", "make_args", "timeout"}, "skip": {"reason"}}[action]
    allowed_flags = {"run": {"slow"}, "skip": set()}[action]
    unknown = sorted(set(values) - allowed_values) + sorted(flags - allowed_flags)
    if unknown:
        raise MarkerError(f"readme-test {action}: unknown attribute(s) {', '.join(unknown)} in {text.strip()!r}")
    if action == "skip":
        reason = values.get("reason", "").strip()
        if not reason:
            raise MarkerError(f'readme-test skip needs reason="...": {text.strip()!r}')
        return Marker("skip", reason=reason)
    timeout_s = None
    if "timeout" in values:
        try:
            timeout_s = float(values["timeout"])
        except ValueError as exc:
            raise MarkerError(f"readme-test timeout must be seconds, got {values['timeout']!r}") from exc
        if timeout_s <= 0:
            raise MarkerError(f"readme-test timeout must be positive, got {values['timeout']!r}")
    args, make_args = values.get("args", ""), values.get("make_args", "")
    return Marker("run", args=args, make_args=make_args, slow="slow" in flags, timeout_s=timeout_s)


def extract_blocks(text: str, path: str = "README.md") -> Extraction:
    """Every fenced block of `text`, with the marker on the line before its fence (or two before, blank between)."""
    lines = text.splitlines()
    out = Extraction(path)
    attached: set[int] = set()
    i = 0
    while i < len(lines):
        opening = FENCE_RE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        lang = opening.group("info").lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE_RE.match(lines[j])
            if (
                closing
                and not closing.group("info")
                and closing.group("fence")[0] == fence[0]
                and len(closing.group("fence")) >= len(fence)
            ):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        marker_line = None
        if i >= 1 and MARKER_RE.match(lines[i - 1]):
            marker_line = i - 1
        elif i >= 2 and not lines[i - 1].strip() and MARKER_RE.match(lines[i - 2]):
            marker_line = i - 2
        marker, error = None, None
        if marker_line is not None:
            attached.add(marker_line)
            try:
                marker = parse_marker(lines[marker_line])
            except MarkerError as exc:
                error = str(exc)
        out.blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", marker, error))
        i = j + 1
    in_block = _lines_inside_blocks(out.blocks, lines)
    for n, line in enumerate(lines):
        if n not in attached and n not in in_block and MARKER_RE.match(line):
            out.orphan_markers.append(n + 1)
    # A marker on a block the harness does not check (```text, ```yaml) is as misplaced as an orphan.
    for block in out.blocks:
        if block.kind is None and block.marker is not None:
            out.orphan_markers.append(block.line)
    out.orphan_markers.sort()
    return out


def _lines_inside_blocks(blocks: list[Block], lines: list[str]) -> set[int]:
    inside: set[int] = set()
    for block in blocks:
        start = block.line - 1
        inside.update(range(start, min(len(lines), start + block.code.count("\n") + 2)))
    return inside


def _unquoted(text: str) -> Iterator[tuple[int, str]]:
    """(index, character) of every character of `text` outside shell quotes and escapes."""
    quote: str | None = None
    escaped = False
    for k, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        else:
            yield k, ch


def _strip_comment(line: str) -> str:
    """`line` without a trailing shell comment (a `#` at a word start, outside quotes)."""
    for k, ch in _unquoted(line):
        if ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def _first_operator(command: str) -> int:
    """Index of the first top-level `|`, `&` or `;` (where appended arguments must go before), else len."""
    return next((k for k, ch in _unquoted(command) if ch in "|&;"), len(command))


def shell_commands(code: str) -> list[str]:
    """The logical commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    commands: list[str] = []
    pending = ""
    for raw in code.splitlines():
        line = _strip_comment(raw) if not pending else _strip_comment(raw).lstrip()
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command:
            commands.append(command)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def runnable_commands(block: Block) -> list[str]:
    """The commands of a `run` bash block that the suite runs, with the marker's extra arguments appended."""
    assert block.marker is not None
    out = []
    for command in shell_commands(block.code):
        if not (command.startswith(RUNNABLE_PREFIXES) or command == "make"):
            continue
        extra = block.marker.make_args if command.startswith("make") else block.marker.args
        if extra:
            cut = _first_operator(command)
            command = f"{command[:cut].rstrip()} {extra} {command[cut:]}".rstrip()
        out.append(command)
    return out


def unmarked(extraction: Extraction) -> list[str]:
    """Problems with markers, one line each: unmarked blocks, unreadable markers, orphans."""
    problems = []
    for block in extraction.checked:
        if block.marker_error:
            problems.append(f"{block.test_id}: {block.marker_error}")
        elif block.marker is not None and block.kind == "python" and (block.marker.args or block.marker.make_args):
            problems.append(f"{block.test_id}: args= and make_args= apply to bash blocks only")
        elif block.marker is None:
            first = next((ln for ln in block.code.splitlines() if ln.strip()), "")
            problems.append(f"{block.test_id}: ```{block.lang} block has no readme-test marker ({first.strip()[:70]})")
    for line in extraction.orphan_markers:
        problems.append(f"{extraction.path}:{line}: marker on no bash/python block")
    return problems


def relative_links(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line, target) of every link to a local file, outside code blocks and inline code."""
    in_fence: str | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        fence = FENCE_RE.match(line)
        if fence:
            if in_fence is None:
                in_fence = fence.group("fence")[0]
                continue
            if fence.group("fence")[0] == in_fence and not fence.group("info"):
                in_fence = None
                continue
        if in_fence is not None:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        targets = [m.group("target") for m in INLINE_LINK_RE.finditer(prose)]
        targets += [m.group("target") for m in HTML_SRC_RE.finditer(prose)]
        ref = REFERENCE_LINK_RE.match(prose)
        if ref:
            targets.append(ref.group("target"))
        for target in targets:
            if not EXTERNAL_RE.match(target):
                yield n, target


def broken_links(md_file: Path, root: Path) -> list[str]:
    """Links of `md_file` whose target is missing or lies outside `root` (a sibling checkout, ../shared)."""
    problems = []
    root = root.resolve()
    for line, target in relative_links(md_file.read_text(encoding="utf-8")):
        path_part = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (md_file.parent / path_part).resolve()
        where = f"{md_file.relative_to(root)}:{line}: {target}"
        if not resolved.is_relative_to(root):
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where} does not exist")
    return problems


def make_environment(root: Path = REPO) -> dict[str, str]:
    """The Makefile's exports: offline, loopback-only, caches under the checkout, this checkout importable."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        DS_BUILD_OPS="0",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(root),
    )
    cache = Path(env.setdefault("DIPRL_CACHE_DIR", str(root / ".cache")))
    env["TMPDIR"] = str(cache / "tmp")
    env["TORCH_EXTENSIONS_DIR"] = str(cache / "torch_extensions")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def venv_python(root: Path = REPO) -> str:
    candidate = root / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def _run(argv: list[str], timeout: float, what: str, env: dict[str, str], cwd: Path) -> None:
    try:
        proc = subprocess.run(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace"))[
            -OUTPUT_TAIL:
        ]
        pytest.fail(f"{what} ran past {timeout:.0f} s (raise timeout= or add args= to the marker)\n{tail}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with status {proc.returncode}\n{proc.stdout[-OUTPUT_TAIL:]}")


def run_block(block: Block, tmp_path: Path, root: Path = REPO) -> None:
    """Run one `run` block: a python block as a script, a bash block's runnable commands one by one."""
    assert block.marker is not None and block.marker.action == "run"
    env = make_environment(root)
    if block.kind == "python":
        script = tmp_path / f"readme_{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        _run([venv_python(root), str(script)], block.marker.timeout, f"python block {block.test_id}", env, root)
        return
    commands = runnable_commands(block)
    if not commands:
        pytest.fail(
            f"{block.test_id}: marked run but has no command starting with "
            f"{' or '.join(repr(p) for p in RUNNABLE_PREFIXES)}; mark it skip with a reason"
        )
    for command in commands:
        _run(["bash", "-o", "pipefail", "-c", command], block.marker.timeout, f"`{command}`", env, root)


# --------------------------------------------------------------------------------- the real README and docs


def _markdown_files() -> list[Path]:
    """README.md and every page of docs/: the files whose blocks are checked and whose links must resolve."""
    return [p for p in [README, *sorted((REPO / "docs").glob("*.md"))] if p.is_file()]


def _extraction(md_file: Path) -> Extraction:
    return extract_blocks(md_file.read_text(encoding="utf-8"), md_file.relative_to(REPO).as_posix())


def _run_params() -> list[object]:
    params: list[object] = []
    for md_file in _markdown_files():
        for block in _extraction(md_file).checked:
            if block.marker is None or block.marker.action != "run":
                continue
            marks = [pytest.mark.slow] if block.marker.slow else []
            params.append(pytest.param(block, id=block.test_id, marks=marks))
    return params


@pytest.mark.parametrize("md_file", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_is_marked(md_file: Path) -> None:
    problems = unmarked(_extraction(md_file))
    name = md_file.relative_to(REPO).as_posix()
    assert not problems, f"{name} blocks need a readme-test marker (see docs/contributing.md):\n" + "\n".join(problems)


@pytest.mark.parametrize("block", _run_params())
def test_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


@pytest.mark.parametrize("md_file", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(md_file: Path) -> None:
    problems = broken_links(md_file, REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


# --------------------------------------------------------------------------------- the harness itself

SCRATCH = """\
# scratch

<!-- readme-test: run args="--games 7 --max-year 1902" make_args="ARENA_ARGS='--games 7'" -->
```bash
.venv/bin/python -m diprl.arena --hero dumbbot --opponents random   # the arena
make ladder
curl -s 127.0.0.1:8000/v1/models
.venv/bin/python -m diprl.evaluate policy=base \\
    games=14 | tail -n 3
```

<!-- readme-test: skip reason="installs into .venv" -->

```bash
make install
```

```python
print("no marker")
```

<!-- readme-test: run slow timeout=900 -->
```python
x = 1
```

```text
not checked
```

<!-- readme-test: run -->

A marker followed by prose is an orphan.

<!-- readme-test: skip -->
```sh
ray up cluster/a100.yaml
```

    ```bash
    make arena
    ```
"""


def test_extractor_finds_blocks_lines_and_markers() -> None:
    ex = extract_blocks(SCRATCH)
    assert [(b.line, b.kind) for b in ex.blocks] == [
        (4, "bash"),
        (14, "bash"),
        (18, "python"),
        (23, "python"),
        (27, None),
        (36, "bash"),
        (40, "bash"),
    ]
    first, skipped, bare, slow, _, bad, indented = ex.blocks
    assert first.marker == Marker("run", args="--games 7 --max-year 1902", make_args="ARENA_ARGS='--games 7'")
    assert skipped.marker == Marker("skip", reason="installs into .venv")  # two lines before, blank between
    assert bare.marker is None
    assert slow.marker == Marker("run", slow=True, timeout_s=900.0)
    assert slow.marker.timeout == 900.0 and first.marker.timeout == DEFAULT_TIMEOUT_S
    assert bad.marker is None and bad.marker_error is not None and "reason" in bad.marker_error
    assert indented.code == "make arena\n" and indented.marker is None
    assert ex.orphan_markers == [31]


def test_unmarked_lists_every_problem_by_line() -> None:
    problems = unmarked(extract_blocks(SCRATCH))
    assert [p.split(":")[1] for p in problems] == ["18", "36", "40", "31"]
    assert "no readme-test marker" in problems[0] and "print(" in problems[0]
    assert "reason" in problems[1]
    assert "marker on no bash/python block" in problems[3]


def test_args_on_a_python_block_are_an_error() -> None:
    text = '<!-- readme-test: run args="--games 7" -->\n```python\nprint(1)\n```\n'
    assert unmarked(extract_blocks(text)) == ["README.md:2: args= and make_args= apply to bash blocks only"]


def test_a_fully_marked_file_has_no_problems() -> None:
    text = (
        '<!-- readme-test: run -->\n```python\nprint(1)\n```\n\n<!-- readme-test: skip reason="x" -->\n'
        "```bash\nls\n```\n"
    )
    assert unmarked(extract_blocks(text)) == []


def test_runnable_commands_append_args_before_pipes_and_drop_the_rest() -> None:
    first = extract_blocks(SCRATCH).blocks[0]
    assert runnable_commands(first) == [
        ".venv/bin/python -m diprl.arena --hero dumbbot --opponents random --games 7 --max-year 1902",
        "make ladder ARENA_ARGS='--games 7'",
        ".venv/bin/python -m diprl.evaluate policy=base games=14 --games 7 --max-year 1902 | tail -n 3",
    ]


def test_comments_inside_quotes_are_kept() -> None:
    assert _strip_comment("make arena ARENA_ARGS='--x #1'  # run it") == "make arena ARENA_ARGS='--x #1'"
    assert _strip_comment("echo a#b") == "echo a#b"


def test_marker_errors_are_clear() -> None:
    for text, needle in [
        ("<!-- readme-test: maybe -->", "run or skip"),
        ('<!-- readme-test: run arg="--x" -->', "unknown attribute(s) arg"),
        ("<!-- readme-test: run fast -->", "unknown attribute(s) fast"),
        ("<!-- readme-test: run timeout=soon -->", "seconds"),
        ('<!-- readme-test: skip reason="" -->', "reason"),
        ('<!-- readme-test: run args="unclosed -->', "unreadable"),
    ]:
        with pytest.raises(MarkerError, match=re.escape(needle)):
            parse_marker(text)
    assert parse_marker("<!-- just a comment -->") is None


def test_links_outside_the_repository_or_missing_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "dumbbot.md").write_text("spec\n")
    (tmp_path / "LICENSE").write_text("AGPL\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[spec](docs/dumbbot.md#values) [gone](docs/gone.md) [map](../shared/ARCHITECTURE.md)\n"
        "[web](https://example.org) [here](#layout) `[code](nowhere.md)` ![img](docs/figures/x.png)\n"
        '<img src="docs/dumbbot.md">\n[licence]: LICENSE\n[missing]: docs/missing.md "title"\n'
        "```markdown\n[in a fence](nowhere.md)\n```\n"
    )
    problems = broken_links(readme, tmp_path)
    assert problems == [
        "README.md:1: docs/gone.md does not exist",
        "README.md:1: ../shared/ARCHITECTURE.md points outside the repository",
        "README.md:2: docs/figures/x.png does not exist",
        "README.md:5: docs/missing.md does not exist",
    ]


def test_run_block_runs_python_and_reports_failures(tmp_path: Path) -> None:
    ok = Block("README.md", 3, "python", "import os\nassert os.environ['HF_HUB_OFFLINE'] == '1'\n", Marker("run"))
    run_block(ok, tmp_path)
    bad = Block("README.md", 9, "python", "raise SystemExit(3)\n", Marker("run"))
    with pytest.raises(pytest.fail.Exception, match="status 3"):
        run_block(bad, tmp_path)
    slow = Block("README.md", 12, "python", "import time\ntime.sleep(30)\n", Marker("run", timeout_s=1.0))
    with pytest.raises(pytest.fail.Exception, match="ran past 1 s"):
        run_block(slow, tmp_path)


def test_run_block_refuses_a_bash_block_with_nothing_runnable(tmp_path: Path) -> None:
    block = Block("README.md", 5, "bash", "curl -s 127.0.0.1:8000/v1/models\n", Marker("run"))
    with pytest.raises(pytest.fail.Exception, match="mark it skip"):
        run_block(block, tmp_path)

"""Every code block of the user-facing docs runs as written and prints what it says.

A user copies these first: a snippet that does not run, imports a name that is gone, or
prints something other than its comment says, is a defect. The docs are ``README.md`` and
``docs/*.md`` (``docs/performance.md`` holds results, no code to copy).

Every ```` ```python ```` block is checked:

- it compiles (top-level ``await`` allowed: asyncio fragments), and every name it imports
  from ``enginecore`` exists;
- unless it is marked, it runs on its own, the way a user runs it: saved as a file and run
  with ``python snippet.py`` in an empty folder, in a process of its own. It must exit 0
  within the timeout. A block that imports an optional package that is not installed
  (``numpy``, ``ray``, ``prometheus_client``, ...) is skipped.
- what it prints is checked against its comments: where a block's top-level-looking
  ``print(...)`` lines each print one line (as many lines printed as ``print(`` lines in
  the source), a comment on a ``print(`` line is what that line prints, possibly followed
  by an explanation after ``:``, ``;``, ``,`` or a space (``# [2, 1, 0]: payloads``). A
  comment with ``...``, ``e.g.`` or ``<`` is an illustration and is not compared.
  ``EXPECTED`` below adds the outputs that the prose around a block describes.

A marker, an HTML comment on the line just before the fence (invisible when rendered),
says how else to treat a block:

- ``<!-- not-run: WHY -->``: a fragment (names defined elsewhere, your own engine, a GPU,
  a cluster or a checkpoint): it is compiled and its imports checked, not run.
- ``<!-- serve: MODULE:FACTORY -->``: the block talks to a stage at
  ``tcp://127.0.0.1:5570``: the test runs ``python -m enginecore serve --engine
  MODULE:FACTORY`` on a free port first, and the block's ``5570`` becomes that port.
- ``<!-- interrupt -->``: the block runs until Ctrl-C: once it has printed its first line,
  it gets SIGINT, and must then exit 0.

The shell commands are checked too: every ``--option`` given to ``python -m enginecore
SUBCOMMAND``, ``python -m benchmarks[.MODULE]`` or ``python examples/NAME.py``, in a shell
block, an inline code span or an example's docstring, is one that command's ``--help``
lists.

And the cross-references: every relative link of the Markdown files (the CHANGELOG and
``docs/performance.md`` included) names a file that exists and, with ``#anchor``, an anchor
(a heading's, as GitHub makes it) of that file; every ``docs/NAME.md#anchor`` the code
names too; and every place, in the docs or the code, that names a doc's section in words
(``wire.md`` section 8, "Restarts"; ``pipelines.md``, "Restart") names a numbered heading,
a heading or a bold run-in heading (``**Restarts.**``) that the doc has.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
DOCS.remove("docs/performance.md")

# Seconds a block may run (each starts processes; Ray's start alone takes ~10 s).
TIMEOUT = 50

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(not-run|serve|interrupt)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    marker: str | None  # "not-run", "serve", "interrupt"
    argument: str  # the marker's text after ':'

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, lang = fence.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        found.append(
            Block(
                doc=doc,
                line=i + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                marker=marker.group(1) if marker else None,
                argument=(marker.group(2) or "") if marker else "",
            )
        )
        i = end + 1
    return found


ALL_BLOCKS = [block for doc in DOCS for block in _blocks(doc)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.marker != "not-run"]

# Outputs the prose around a block describes, beyond its comments: (doc, a text unique to
# the block) -> a regex per line printed, in order.
EXPECTED: dict[tuple[str, str], list[str]] = {
    # "Ctrl-C prints ('shutdown',) and returns"
    ("README.md", "class EchoEngine"): [
        re.escape("('output', ('r1', 'hello'))"),
        r"\('shutdown',\)",
    ],
    # "{replica: 0, ...}": each of the four replicas answers 0
    ("README.md", 'pool.call_utility("num_requests"'): [
        re.escape("[2, 1, 0]"),
        r"\{<Replica r0 [^>]*>: 0(, <Replica r[123] [^>]*>: 0){3}\}",
    ],
    # "{replica: answer, ...}": each of the four replicas answers its pid
    ("docs/pool.md", 'pool.call_utility("pid"'): [
        re.escape("['r0', 'r1', 'r2', 'r3', 'r0', 'r1', 'r2', 'r3']"),
        "800",
        r"\{<Replica r0 [^>]*pid=(\d+)[^>]*>: \1(, <Replica r[123] [^>]*pid=(\d+)[^>]*>: \3){3}\}",
    ],
    # "It prints a's three outputs and b's first three, then ('shutdown',)."
    ("docs/engines.md", "class DeviceCountdown"): [
        *(
            re.escape(f"('output', ('{rid}', {left}))")
            for a in (2, 1, 0)
            for rid, left in (("a", a), ("b", a + 2))
        ),
        r"\('shutdown',\)",
    ],
    # "It prints ('utility', 2, 0.5, None) at once, ('utility', 1, None, None) 50 ms later,
    # then call 3's LoopEndedError answer and ('shutdown',)."
    ("docs/engines.md", "class WithSlowUtilities"): [
        re.escape("('utility', 2, 0.5, None)"),
        re.escape("('utility', 1, None, None)"),
        r"\('utility', 3, None, 'LoopEndedError\(.*\)'\)",
        r"\('shutdown',\)",
    ],
    ("docs/observability.md", "stream.timings"): [
        r"ttft \d+\.\d\d ms, 50 outputs, mean gap \d+\.\d µs, max gap \d+\.\d µs, "
        r"total \d+\.\d\d ms, finished"
    ],
    ("docs/observability.md", "loop.statistics()"): [
        r"(\d+ ){4}[\d.e+-]+ [\d.e+-]+",  # busy and idle seconds: 1e-05 too
        r"step p50 <= .*",
    ],
    ("docs/wire.md", "msgspec.msgpack.decode(body)"): [
        r"\['outputs', \['r1'\], \[False\], \[2\], \{'seq': 1, .*\}\]",
        r"\['outputs', \['r1'\], \[False\], \[1\].*\]",
        r"\['outputs', \['r1'\], \[True\], \[0\].*\]",
    ],
}


def _expected(block: Block) -> list[str] | None:
    found = [v for (doc, text), v in EXPECTED.items() if doc == block.doc and text in block.code]
    assert len(found) <= 1, f"{block.id}: two EXPECTED entries match"
    return found[0] if found else None


def test_expected_entries_each_match_a_block() -> None:
    for doc, text in EXPECTED:
        matching = [b for b in PYTHON if b.doc == doc and text in b.code]
        assert len(matching) == 1, f"EXPECTED[{doc!r}, {text!r}] matches {len(matching)} blocks"


def _print_claims(code: str) -> tuple[int, list[tuple[int, str]]]:
    """How many ``print(`` lines *code* has, and (index among them, comment) for those with
    a comment that claims an output (not an illustration)."""
    count = 0
    claims: list[tuple[int, str]] = []
    for line in code.splitlines():
        stripped = line.strip()
        if not stripped.startswith("print("):
            continue
        if "  # " in line:
            comment = line.split("  # ", 1)[1].strip()
            if not any(mark in comment for mark in ("...", "e.g.", "<")):
                claims.append((count, comment))
        count += 1
    return count, claims


def check_output(code: str, stdout: str, expected: list[str] | None = None) -> list[str]:
    """What is wrong with *stdout* as the output of *code*: one message per problem."""
    problems: list[str] = []
    lines = stdout.splitlines()
    count, claims = _print_claims(code)
    if claims and count != len(lines):
        problems.append(
            f"{count} print( lines in the block, {len(lines)} lines printed: the comments "
            f"cannot be checked against {lines!r}"
        )
    elif claims:
        for index, comment in claims:
            line = lines[index]
            rest = comment[len(line) :]
            if not (comment.startswith(line) and (rest == "" or rest[0] in ":;, ")):
                problems.append(f"printed {line!r}, the comment says {comment!r}")
    if expected is not None:
        if len(lines) != len(expected):
            problems.append(f"printed {len(lines)} lines, expected {len(expected)}: {lines!r}")
        for line, pattern in zip(lines, expected, strict=False):
            if not re.fullmatch(pattern, line):
                problems.append(f"printed {line!r}, expected /{pattern}/")
    return problems


class TestOutputCheck:
    """The checker itself catches a snippet that drifted from its comments."""

    def test_a_matching_output_passes(self) -> None:
        code = "print([2, 1, 0])   # [2, 1, 0]: payloads\nprint(0.25)  # 0.25; errors\nprint(1)\n"
        assert check_output(code, "[2, 1, 0]\n0.25\n1\n") == []

    def test_a_wrong_output_fails(self) -> None:
        code = "print([2, 1])   # [2, 1, 0]\n"
        assert check_output(code, "[2, 1]\n") == ["printed '[2, 1]', the comment says '[2, 1, 0]'"]

    def test_an_extra_line_fails(self) -> None:
        assert check_output("print(1)  # 1\n", "1\n2\n")

    def test_an_illustration_is_not_compared(self) -> None:
        assert check_output("print(x)  # {replica: 0, ...}\n", "{'r0': 0}\n") == []

    def test_a_prose_expectation_is_compared(self) -> None:
        assert check_output("print(1)\n", "1\n", [r"2"])
        assert check_output("print(1)\n", "1\n", [r"1"]) == []

    def test_the_markers_are_read(self) -> None:
        markers = {b.marker for b in PYTHON}
        assert {"not-run", "serve", "interrupt", None} <= markers
        assert all(b.argument for b in PYTHON if b.marker in ("not-run", "serve")), (
            "a not-run marker says why; a serve marker names the factory"
        )


def _compile(block: Block) -> ast.Module:
    try:
        tree = compile(
            block.code,
            block.id,
            "exec",
            flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            dont_inherit=True,
        )
    except SyntaxError as exc:
        pytest.fail(f"{block.id}: not valid Python: {exc}")
    assert isinstance(tree, ast.Module)
    return tree


def _imports(tree: ast.Module) -> Iterator[tuple[str, list[str]]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_block_compiles_and_its_enginecore_imports_exist(block: Block) -> None:
    tree = _compile(block)
    for module, names in _imports(tree):
        if module.split(".")[0] != "enginecore":
            continue
        if module.startswith("enginecore.engines.transformers"):
            pytest.importorskip("transformers", reason="the transformers extra is not installed")
        if module == "enginecore.stage.ray":
            pytest.importorskip("ray", reason="the ray extra is not installed")
        if module == "enginecore.stage.prometheus":
            pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
        imported = importlib.import_module(module)
        missing = [name for name in names if not hasattr(imported, name)]
        assert not missing, f"{block.id}: {module} has no {missing}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _served(factory: str, cwd: Path) -> Iterator[int]:
    """``python -m enginecore serve --engine FACTORY`` on a free port, until the block ran."""
    port = _free_port()
    log = cwd / "serve.log"
    with log.open("w") as stderr, subprocess.Popen(
        [sys.executable, "-m", "enginecore", "serve", "--engine", factory,
         "--bind", f"tcp://127.0.0.1:{port}"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "enginecore serve: listening on ..." once it is up
            assert "listening on" in line, f"serve did not start: {line}{log.read_text()}"
            yield port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _run(block: Block, script: Path, cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if block.marker != "interrupt":
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=TIMEOUT, check=False,
        )  # fmt: skip
        return proc.returncode, proc.stdout, proc.stderr
    # Runs until Ctrl-C: once it printed its first line, send SIGINT, as a terminal would.
    with subprocess.Popen(
        [sys.executable, str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as popen:  # fmt: skip
        assert popen.stdout is not None
        first = popen.stdout.readline()
        popen.send_signal(signal.SIGINT)
        try:
            out, err = popen.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            popen.kill()
            out, err = popen.communicate()
        return popen.returncode, first + out, err


@cache
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_and_prints_what_it_says(block: Block, tmp_path: Path) -> None:
    tree = _compile(block)
    for module, _ in _imports(tree):
        top = module.split(".")[0]
        if not _has(top):
            pytest.skip(f"{block.id} needs {top}, not installed")
    if "import ray" in block.code or "enginecore.stage.ray" in block.code:
        pytest.importorskip("ray", reason="the ray extra is not installed")
    script = tmp_path / "snippet.py"
    with contextlib.ExitStack() as stack:
        code = block.code
        if block.marker == "serve":
            port = stack.enter_context(_served(block.argument, tmp_path))
            assert "127.0.0.1:5570" in code, f"{block.id}: a serve block talks to :5570"
            code = code.replace("127.0.0.1:5570", f"127.0.0.1:{port}")
        script.write_text(code, encoding="utf-8")
        returncode, stdout, stderr = _run(block, script, tmp_path)
    assert returncode == 0, f"{block.id} exited {returncode}:\n{stdout}\n{stderr}"
    problems = check_output(block.code, stdout, _expected(block))
    assert not problems, f"{block.id}:\n" + "\n".join(problems) + f"\nstdout:\n{stdout}"


# -- the shell commands --------------------------------------------------------------------

_COMMAND = re.compile(
    r"python (?:-m (?P<module>enginecore|benchmarks(?:\.\w+)?)|(?P<script>examples/\w+\.py))"
    r"(?P<args>[^`\n]*)"
)
_SUBCOMMANDS = ("serve", "top", "keygen")


def _commands() -> list[tuple[str, tuple[str, ...], str]]:
    """(doc, the command's argv prefix, its options) for each command the docs show, in
    shell blocks and inline code spans alike, and the examples' docstrings."""
    found: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    examples = sorted(f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py"))
    for doc in [*DOCS, *examples]:  # the examples' docstrings say how to run them
        # A shell line continued with a backslash is one command.
        text = (ROOT / doc).read_text(encoding="utf-8").replace("\\\n", " ")
        for match in _COMMAND.finditer(text):
            words = match.group("args").split()
            if match.group("module"):
                prefix: tuple[str, ...] = ("-m", match.group("module"))
                if match.group("module") == "enginecore":
                    if not words or words[0] not in _SUBCOMMANDS:
                        continue  # prose: "python -m enginecore ..." without a subcommand
                    prefix = (*prefix, words[0])
            else:
                prefix = (match.group("script"),)
            options = {
                w.strip("[]|,.)(`").split("=")[0] for w in words if w.lstrip("[").startswith("--")
            }
            found.setdefault((doc, prefix), set()).update(options)
    # A command without options needs no check (and an example without argparse would run).
    return [
        (doc, prefix, " ".join(sorted(opts)))
        for (doc, prefix), opts in sorted(found.items())
        if opts
    ]


COMMANDS = _commands()


@cache
def _help(prefix: tuple[str, ...]) -> str:
    proc = subprocess.run(
        [sys.executable, *prefix, "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{' '.join(prefix)} --help exited {proc.returncode}: {proc.stderr}"
    )
    return proc.stdout


def test_the_docs_show_commands() -> None:
    prefixes = {prefix for _, prefix, _ in COMMANDS}
    assert ("-m", "enginecore", "serve") in prefixes
    assert ("-m", "benchmarks.soak_stage") in prefixes
    assert ("examples/openai_server.py",) in prefixes


@pytest.mark.parametrize(
    ("doc", "prefix", "options"), COMMANDS, ids=[f"{d}:{' '.join(p)}" for d, p, _ in COMMANDS]
)
def test_command_options_exist(doc: str, prefix: tuple[str, ...], options: str) -> None:
    if prefix == ("examples/openai_server.py",):
        pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    if prefix == ("-m", "enginecore", "top"):
        pytest.importorskip("rich", reason="the top extra is not installed")
    usage = _help(prefix)
    listed = set(re.findall(r"--[\w-]+", usage))
    missing = [opt for opt in options.split() if opt not in listed]
    assert not missing, f"{doc}: python {' '.join(prefix)} has no {missing}"


# -- the signatures the docs spell out ------------------------------------------------------


def test_pipeline_stage_signature_block_is_current() -> None:
    """pipelines.md lists PipelineStage's parameters with their defaults, as a call: each is
    a parameter of that name, in that order, with that default."""
    from enginecore.stage import PipelineStage

    (block,) = [
        b for b in PYTHON if b.doc == "docs/pipelines.md" and b.code.startswith("PipelineStage(")
    ]
    call = _compile(block).body[0]
    assert isinstance(call, ast.Expr)
    assert isinstance(call.value, ast.Call)
    parameters = inspect.signature(PipelineStage).parameters
    documented = [arg.id for arg in call.value.args if isinstance(arg, ast.Name)]
    documented += [kw.arg for kw in call.value.keywords if kw.arg is not None]
    assert documented == list(parameters), "the block's parameters, in order"
    for kw in call.value.keywords:
        assert kw.arg is not None
        default = eval(compile(ast.Expression(kw.value), block.id, "eval"), {})
        assert default == parameters[kw.arg].default, f"{kw.arg}: documented {default!r}"


# -- links, anchors and named sections ------------------------------------------------------

# Every Markdown file a link may point into: the docs, performance.md and the CHANGELOG too.
MARKDOWN = [
    "README.md",
    "CHANGELOG.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
]
# Where prose names a doc's section in words: the docstrings and comments of the code too.
SOURCES = [
    *MARKDOWN,
    *sorted(str(p.relative_to(ROOT)) for d in ("src", "tests", "benchmarks", "examples")
            for p in (ROOT / d).rglob("*.py")),
]  # fmt: skip

_LINK = re.compile(r"\]\(([^)\s]+)\)")
# ``docs/wire.md`` section 8, "Restarts" / pipelines.md, "Restart" / stage.md ("Limits")
_SECTION_REF = re.compile(
    r"(?:docs/)?(?P<doc>[a-z]+)\.md`{0,2}\)?,?\s+"
    r"\(?(?:section (?P<number>\d+)(?:,\s+\"(?P<sub>[^\"]+)\")?|\"(?P<title>[^\"]+)\")"
)


def _prose_lines(text: str) -> Iterator[str]:
    """*text*'s lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (markup gone) lowercased, punctuation but
    ``-`` and ``_`` dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a Markdown *text* defines: its headings' (a repeated one gets ``-1``,
    ``-2``, ... as on GitHub) and its explicit ``<a id=...>`` / ``<a name=...>``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def titles(text: str) -> list[str]:
    """What prose may name a section of *text* by: its headings and its bold run-in
    headings (``**Tagged aborts.**``), code marks dropped, spaces collapsed."""
    found = []
    for line in _prose_lines(text):
        heading = re.match(r"#{1,6}\s+(.*)", line)
        found += [heading.group(1)] if heading else []
        found += re.findall(r"\*\*([^*]+?)\*\*", line)
    return [" ".join(t.replace("`", "").split()) for t in found]


def broken_links(doc: str, text: str, read: dict[str, str]) -> list[str]:
    """The relative links of Markdown *text* (at path *doc*) whose file is missing, or
    whose ``#anchor`` that file (a Markdown one, in *read*: path -> text) does not define."""
    problems = []
    here = Path(doc).parent
    for line in _prose_lines(text):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(here / path) if path else doc
            if resolved not in read and not (ROOT / resolved).exists():
                problems.append(f"{doc}: link {target!r}: no file {resolved}")
            elif (
                anchor
                and resolved.endswith(".md")
                and anchor not in anchors(read.get(resolved) or (ROOT / resolved).read_text())
            ):
                problems.append(f"{doc}: link {target!r}: {resolved} has no #{anchor}")
    return problems


def broken_section_refs(source: str, text: str, read: dict[str, str]) -> list[str]:
    """The places in *text* that name a section of a doc (``wire.md section 8,
    "Restarts"``; ``pipelines.md``, "Restart"``) that the doc (in *read*: its path under
    ``docs/`` -> its text) does not have, as a numbered heading or a title's start."""
    problems = []
    for ref in _SECTION_REF.finditer(text):
        doc = f"docs/{ref['doc']}.md"
        if doc not in read:
            continue  # another project's file, or README.md
        named = titles(read[doc])
        if ref["number"] and not any(t.startswith(f"{ref['number']}. ") for t in named):
            problems.append(f"{source}: {ref[0]!r}: {doc} has no section {ref['number']}")
        title = ref["sub"] or ref["title"]
        if title and not any(t.startswith(" ".join(title.split())) for t in named):
            problems.append(f"{source}: {ref[0]!r}: {doc} has no section {title!r}")
    return problems


@cache
def _markdown() -> dict[str, str]:
    return {doc: (ROOT / doc).read_text(encoding="utf-8") for doc in MARKDOWN}


class TestLinkCheck:
    """The checkers themselves catch a link, an anchor or a section name that rotted."""

    def test_slugs_are_githubs(self) -> None:
        assert slug("Retry: `on_next_error=Retry(n)`") == "retry-on_next_errorretryn"
        assert slug('Routing outputs to requests, and "finished"') == (
            "routing-outputs-to-requests-and-finished"
        )
        assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}

    def test_a_missing_file_or_anchor_is_reported(self) -> None:
        read = {"docs/a.md": "# Top\n## Some part\n", "docs/b.md": "## Here\n"}
        assert (
            broken_links("docs/b.md", "[x](a.md#some-part) [y](#here) [z](../README.md)", read)
            == []
        )
        assert broken_links("docs/b.md", "[y](#top)", read) == [
            "docs/b.md: link '#top': docs/b.md has no #top"
        ]
        assert broken_links("docs/b.md", "[x](a.md#some-parts)", read) == [
            "docs/b.md: link 'a.md#some-parts': docs/a.md has no #some-parts"
        ]
        assert broken_links("docs/b.md", "[x](gone.md)", read) == [
            "docs/b.md: link 'gone.md': no file docs/gone.md"
        ]
        assert broken_links("docs/b.md", "```\n[x](gone.md)\n```\n[w](https://x.org)", read) == []

    def test_a_missing_section_is_reported(self) -> None:
        read = {"docs/a.md": "## 3. Handshake\n**Observers.** A peer\n### Restart: `x`\n"}
        good = 'a.md section 3, "Observers"; ``docs/a.md``, "Restart"; a.md ("Restart")'
        assert broken_section_refs("s.py", good, read) == []
        assert broken_section_refs("s.py", 'a.md section 4 and a.md, "Threads"', read) == [
            "s.py: 'a.md section 4': docs/a.md has no section 4",
            "s.py: 'a.md, \"Threads\"': docs/a.md has no section 'Threads'",
        ]


def test_links_and_anchors_resolve() -> None:
    read = _markdown()
    problems = [p for doc, text in read.items() for p in broken_links(doc, text, read)]
    # The code names pages by path, sometimes with an anchor: docs/observability.md#prometheus
    for source in SOURCES:
        if source.endswith(".py") and source != "tests/test_docs.py":  # not its own examples
            text = (ROOT / source).read_text(encoding="utf-8")
            for doc, anchor in re.findall(r"\b(docs/[a-z]+\.md)(?:#([\w-]+))?", text):
                if doc not in read:
                    problems.append(f"{source}: names {doc}, which does not exist")
                elif anchor and anchor not in anchors(read[doc]):
                    problems.append(f"{source}: names {doc}#{anchor}, which it does not define")
    assert not problems, "\n".join(problems)


def test_named_sections_exist() -> None:
    read = {doc: text for doc, text in _markdown().items() if doc.startswith("docs/")}
    problems = []
    for source in SOURCES:
        text = (ROOT / source).read_text(encoding="utf-8")
        problems += broken_section_refs(source, text, read)
    assert not problems, "\n".join(problems)

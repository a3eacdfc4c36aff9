"""README.md and the docs/ pages against the code.

The README opens with the two quick-start commands (.ci/run runs the test one verbatim) and stays under 12 KB; every
driver variable, config key, summary field, command, flag, repository file and link the README and docs/ pages name
exists (variables: ``sftprof.launch.variables.VARIABLES``; keys: ``sftprof/config/schema.py``; summary fields:
``sftprof/analysis/schema.py``; commands: the argparse definitions of the entry points, read without running them);
every driver variable is documented, and docs/configuration.md's table of keys is the schema's. docs/examples/ (run
outputs) is not scanned.
"""
import ast
import re
import subprocess
import types
import typing
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sftprof.analysis.schema import ProfileSummary
from sftprof.config import ConfigError, load_config
from sftprof.config.schema import SFTProfileConfig
from sftprof.launch import variables

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
RUN_COMMAND = ("pip install torch==2.13.0 && pip install -e . -c constraints.txt && CONFIG=tiny_cpu bash "
               "run_qwen3_30b_a3b_sft_profile.sh")
# Names the docs give as misspellings of driver variables (the driver must stop on them, or warn: checked below).
MISSPELLED = ("PROFILE_STEP", "N_GPU_PER_NODE", "LOGPROB_CHUNK_SIZE", "PROFILE_FOO")
# Config keys of earlier releases that the docs say are refused (checked below).
REFUSED_KEYS = ("actor.logprobs_chunk_size", "actor.megatron.lm_head_loss_chunk_size",
                "actor.megatron.enable_chunked_logits")
SECTIONS = ("cluster", "actor", "profile", "train_dataset", "perf_tracer", "memory_profiler")
# Entry points -> the file whose argparse definitions give their subcommands and flags.
CLIS = {"postprocess_profile.py": "postprocess_profile.py", "profile_rank_utils.py": "profile_rank_utils.py",
        "train_sft_profile.py": "sftprof/trainer.py", "-m sftprof.launch": "sftprof/launch/cli.py",
        "-m sftprof.analysis.trace.check": "sftprof/analysis/trace/check.py", "-m sftprof.pycheck": "sftprof/pycheck.py"}
# Entry points whose subcommand parses its own arguments in a module of the package.
DELEGATED = {"postprocess_profile.py": "sftprof/analysis/compare/command.py"}  # compare
# Paths under these folders belong to other projects (megatron-core, TE, torch): not this repository's files.
FOREIGN = ("megatron/", "transformer_engine/", "torch/", "apex/")
# The trace regions the trainer annotates (sftprof.artifacts), named like paths.
REGIONS = re.compile(r"sftprof/(step|forward|backward|optimizer_step)\b")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code(text: str) -> list[str]:
    """Inline code spans and code-block lines of a Markdown text."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    return [line for b in blocks for line in b.splitlines()] + inline


@lru_cache(maxsize=None)
def _repo_code() -> str:
    """Every Python and shell file that git tracks, concatenated (what a named identifier must appear in; files git
    ignores are not the repository's, and a clean clone has none of them); every one on disk outside a git checkout."""
    listed = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True)
    files = ([ROOT / name for name in listed.stdout.splitlines()] if listed.returncode == 0 else
             [p for ext in ("py", "sh") for p in ROOT.rglob(f"*.{ext}")])
    return "\n".join(_text(p) for p in files if p.is_file())


def _schema_keys() -> dict[str, object]:
    """Every leaf key of the config schema -> its default."""
    out = {}

    def walk(node, prefix):
        for k in node:
            if OmegaConf.is_dict(node[k]):
                walk(node[k], f"{prefix}{k}.")
            else:
                out[prefix + k] = node[k]
    walk(OmegaConf.structured(SFTProfileConfig), "")
    return out


def test_readme_is_a_short_guide_with_the_quick_start_first():
    text = _text(README)
    assert len(text.encode()) <= 12288
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks)
    run_cmd, test_cmd = (b.strip() for b in blocks)
    assert run_cmd == RUN_COMMAND
    assert "pytest" in test_cmd
    assert text.index(run_cmd) < text.index("## Running the real job") < text.index("## Reading the results")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


def test_every_driver_variable_is_documented():
    """docs/driver_variables.md is generated from the table (tests/test_driver.py checks it is current); the README
    links it, and it lists every variable."""
    table = _text(ROOT / "docs" / "driver_variables.md")
    named = re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", table, flags=re.M)
    assert named == [v.name for v in variables.VARIABLES]
    assert "(docs/driver_variables.md)" in _text(README)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_variables_named_exist(page):
    """Every upper-case name with an underscore is a driver variable, a documented misspelling, or appears in the
    code (an environment variable another tool reads, a constant, a placeholder the CLIs use)."""
    names = set(re.findall(r"(?<![\w.$-])([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)(?![\w])", _text(page)))
    unknown = sorted(n for n in names if n not in variables.BY_NAME and n not in MISSPELLED
                     and not re.search(rf"\b{n}\b", _repo_code()))
    assert not unknown, f"{page.name} names variables the code does not know: {unknown}"


def test_documented_misspellings_stop_the_driver_or_warn():
    for name in MISSPELLED:
        assert name not in variables.BY_NAME
        assert [s[0] for s in variables.suspect_variables({name: "1"})] == [name]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_config_keys_named_exist(page):
    keys = _schema_keys()
    prefixes = {k.rsplit(".", i)[0] for k in keys for i in range(k.count(".") + 1)}
    named = set()
    for span in _code(_text(page)):
        named |= set(re.findall(rf"(?<![\w.])((?:{'|'.join(SECTIONS)})(?:\.[a-z_0-9]+)+)", span))
    unknown = sorted(k for k in named if k not in prefixes and k not in REFUSED_KEYS)
    assert not unknown, f"{page.name} names config keys the schema does not have: {unknown}"



@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_config_key_choices_named_are_accepted(page):
    """A ``key=a|b|c`` a page lists gives values the key accepts (the README once said ``transformer_impl=auto|on|off``
    after the choices became ``auto|transformer_engine|local``: ``off`` read as False and was refused)."""
    keys = _schema_keys()
    refused = []
    for span in _code(_text(page)):
        for key, values in re.findall(rf"(?<![\w.])((?:{'|'.join(SECTIONS)})(?:\.[a-z_0-9]+)+)=([\w:-]+(?:\|[\w:-]+)+)",
                                      span):
            if key not in keys:
                continue  # test_config_keys_named_exist says so
            for value in values.split("|"):
                try:
                    load_config("tiny_cpu", [f"{key}={value}"])
                except ConfigError as err:
                    refused.append(f"{key}={value}: {err}")
    assert not refused, f"{page.name} lists values the config refuses: {refused}"

def test_refused_keys_are_refused():
    for key in REFUSED_KEYS:
        with pytest.raises(ConfigError, match="not in"):
            load_config("tiny_cpu", [f"{key}=1"])


def _cell(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if OmegaConf.is_list(value) or isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return '""' if value == "" else str(value)


def test_configuration_page_lists_every_key_with_its_defaults():
    shipped = load_config(str(ROOT / "qwen3_30b_a3b_sft_profile.yaml"))
    table = _text(ROOT / "docs" / "configuration.md").split("## Every key", 1)[1]
    rows = [re.split(r"(?<!\\)\|", line)[1:4] for line in table.splitlines() if line.startswith("| `")]
    got = [(key.strip().strip("`"), d.strip().replace("\\|", "|"), s.strip().replace("\\|", "|")) for key, d, s in rows]
    expected = []
    for key, default in _schema_keys().items():
        node = shipped
        for part in key.split("."):
            node = getattr(node, part)
        expected.append((key, _cell(default), _cell(node)))
    assert got == expected


def _member_type(tp):
    """The TypedDict (or other type) inside ``NotRequired[...]``, ``Optional[...]`` and ``list[...]``."""
    while typing.get_origin(tp) in (typing.NotRequired, typing.Union, types.UnionType, list):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _summary_path_exists(path: str) -> bool:
    """``kernel_traces[].summary.gpu`` and the like, walked through the TypedDicts of ``ProfileSummary``."""
    tp = ProfileSummary
    for part in path.replace("[]", "").split("."):
        tp = _member_type(tp)
        hints = typing.get_type_hints(tp, include_extras=True) if hasattr(tp, "__required_keys__") else {}
        if part not in hints:
            return False
        tp = hints[part]
    return True


def test_summary_fields_named_exist():
    members = typing.get_type_hints(ProfileSummary)
    text = _text(ROOT / "docs" / "summary.md")
    named = [span for span in re.findall(r"`([a-z_]+(?:\[\])?(?:\.[a-z_]+(?:\[\])?)+)`", text)
             if span.split(".")[0].split("[")[0] in members
             and not re.search(r"\.(jsonl|json|csv|md|png|yaml|log|pickle)$", span)]
    assert len(named) > 40
    missing = [p for p in named if not _summary_path_exists(p)]
    assert not missing, f"docs/summary.md names summary fields the schema does not have: {missing}"


@lru_cache(maxsize=None)
def _cli(path: str) -> tuple[frozenset, frozenset]:
    """(subcommands, flags) of an entry point, from its argparse calls (``add_parser``, ``add_argument``) and the
    subcommand names it compares ``argv[0]`` with."""
    tree = ast.parse(_text(ROOT / path))
    subs, flags = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            if node.func.attr == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
            elif node.func.attr == "add_parser":
                subs.add(node.args[0].value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Subscript) \
                and isinstance(node.left.value, ast.Name) and node.left.value.id == "argv":  # argv[0] == "compare"
            for c in node.comparators:
                subs |= {e.value for e in (c.elts if isinstance(c, ast.Tuple) else [c]) if isinstance(e, ast.Constant)}
        if isinstance(node, ast.FunctionDef) and node.name == "_run" and path == "sftprof/launch/cli.py":
            flags |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and str(c.value).startswith("-")}
    if path in DELEGATED:
        flags |= _cli(DELEGATED[path])[1]
    return frozenset(subs), frozenset(flags | {"-h", "--help"})


def _commands(page: Path) -> list[tuple[str, str, list[str]]]:
    """(entry point, its file, the words after it) of every command line a page names."""
    out = []
    names = "|".join(re.escape(c) for c in (*CLIS, "run_qwen3_30b_a3b_sft_profile.sh")) + r"|bench/\w+\.py"
    for span in _code(_text(page)):
        for m in re.finditer(rf"({names})((?:\s+[^\s;|&`)]+)*)", span):
            cli = m.group(1)
            words = m.group(2).split()
            if cli == "run_qwen3_30b_a3b_sft_profile.sh":
                out.append((cli, "sftprof/launch/cli.py", words))
            else:
                out.append((cli, CLIS.get(cli, cli), words))
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_commands_named_exist(page):
    keys = _schema_keys()
    bad = []
    for cli, path, words in _commands(page):
        if not (ROOT / path).is_file():
            bad.append(f"{cli} (no {path})")
            continue
        subs, flags = _cli(path)
        for w in words:
            flag = w.split("=")[0]
            if re.fullmatch(r"--?[a-z][\w-]*", flag) and flag not in flags:
                bad.append(f"{cli} {flag}")
        first = words[0] if words else ""
        if subs and cli != "run_qwen3_30b_a3b_sft_profile.sh" and re.fullmatch(r"[a-z_]+", first) and first not in subs:
            bad.append(f"{cli} {first}")
        if cli == "run_qwen3_30b_a3b_sft_profile.sh":
            bad += [f"{cli} {w}" for w in words if re.match(r"[a-z_][\w.]*=", w) and w.split("=")[0] not in keys]
    assert not bad, f"{page.name} names commands, subcommands or flags the code does not have: {bad}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_files_and_links_named_exist(page):
    text = _text(page)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(dest), flags=re.M)}
            bad += [target] if anchor not in slugs else []
    for span in _code(text):
        for path in re.findall(r"(?<![\w./<>$-])((?:sftprof|tests|bench|docs|\.ci)/[\w./-]*|[\w-]+\.(?:py|sh|toml))\b", span):
            path = path.rstrip(".")
            if path.startswith(FOREIGN) or REGIONS.match(path):
                continue
            if not ((ROOT / path).exists() or any(ROOT.rglob(path.split("/")[-1]))):
                bad.append(path)
    assert not bad, f"{page.name} names files or links that do not exist: {sorted(set(bad))}"


def test_readme_links_every_docs_page():
    text = _text(README)
    pages = [p for p in DOCS if p != README]
    assert [p.name for p in pages if f"(docs/{p.name})" not in text] == []


def _module_map_rows() -> list[tuple[str, list[str], str]]:
    """``(folder, first-cell names, whole row)`` of each table row of ARCHITECTURE.md's module map and its Models
    table (whose names are relative to ``sftprof/models/``)."""
    text = _text(ROOT / "docs" / "ARCHITECTURE.md")
    rows = []
    for start, end, folder in (("## Module map", "## Models", ""), ("## Models", "## Data flow", "sftprof/models/")):
        section = text[text.index(start):text.index(end)]
        for row in re.findall(r"^\| (`.*)$", section, flags=re.M):
            first = row.split(" | ")[0]
            rows.append((folder, re.findall(r"`([^`]+)`", first), row))
    return rows


def test_architecture_module_map_names_every_module():
    """docs/ARCHITECTURE.md's module map names every module of the package, and every module it names exists: a
    path (``sftprof/analysis/views/split.py``, a sibling ``view_windows.py`` after it), or a bare name in the row of its
    package (``sftprof/launch/``: ``planning``; ``layers/<op>_kernels.py``: ``norm_kernels``). It once left the five
    modules of ``sftprof/ops/`` unnamed."""
    rows = _module_map_rows()
    named, missing = set(), []
    for folder, names, row in rows:
        base = None
        for name in names:
            path = folder + name if not name.startswith("sftprof/") or not folder else name
            if "<" in path:  # a pattern row: the modules it lists by name, in its own folder
                pkg = path.rsplit("/", 1)[0]
                named |= {f"{pkg}/{m}.py" for m in re.findall(r"`(\w+)`", row)}
                continue
            if path.endswith("/"):  # a package row: its modules by bare name
                named |= {f"{path}{m}.py" for m in re.findall(r"`(\w+)`", row) if (ROOT / f"{path}{m}.py").is_file()}
                continue
            if not path.endswith(".py"):
                continue
            if "/" not in name and base:  # a sibling of the cell's first path
                path = f"{base}/{name}"
            base = path.rsplit("/", 1)[0] if "/" in path else None
            named.add(path)
            if not (ROOT / path).is_file():
                missing.append(path)
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "sftprof").rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts)
    unnamed = [m for m in modules if m not in named]
    assert not missing, f"ARCHITECTURE.md's module map names modules that do not exist: {missing}"
    assert not unnamed, f"ARCHITECTURE.md's module map does not name: {unnamed}"

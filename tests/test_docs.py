"""The documentation site (mkdocs.yml, docs/) builds, and its examples work as written.

* ``mkdocs build --strict`` succeeds (zero warnings), into a temporary folder, and the generated
  pages (the command line's reference, the API reference) hold what they are generated from.
* Every ``python`` block of ``docs/*.md`` runs as written: one page's blocks in order in one
  namespace, in a temporary working directory, on one torch thread. Pages whose blocks load the
  real default model are ``slow`` (they request ``default_model``, which loads it once per
  session; the blocks load it again from the cache).
* Every ``bash`` line that runs ``depthscope`` names a real sub-command and only its real options
  (as ``tests/test_readme.py`` checks the README); every file it reads either ships with
  depthscope (``$(depthscope data NAME)``) or is written by an earlier line of the same block
  (an ``--out`` folder, a ``>`` redirection), and every ``$VARIABLE`` is set earlier in the
  block. ``make`` lines name real Makefile targets.
* The cheap shell lines run: ``depthscope --version``, ``depthscope --help``, ``depthscope data``
  and every ``$(depthscope data NAME)``.
* ``python -m benchmarks --docs PAGE`` rewrites exactly the block between the benchmarks page's
  markers, and the block on the page has the shape it writes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from command_lines import check_options

from depthscope.analyses.jobs.data import GENERATED

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
DATA_SUB = re.compile(r"\"?\$\(depthscope data (\w+)\)\"?")
VAR_USE = re.compile(r"\$\{?(\w+)")
#: options whose path is written, not read
OUTPUT_PARAMS = {"out", "store", "copy"}
#: options and arguments that name checkpoints or files to read although typed as plain strings
INPUT_PARAMS = {"checkpoints", "checkpoint", "model"}


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def blocks(page: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text(encoding="utf-8")) if kind == lang]


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


def loads_real_model(page: Path) -> bool:
    return any("load_model(" in b for b in blocks(page, "python"))


PYTHON_PAGES = [p for p in pages() if blocks(p, "python")]
MODEL_PAGES = [p for p in PYTHON_PAGES if loads_real_model(p)]
PLAIN_PAGES = [p for p in PYTHON_PAGES if not loads_real_model(p)]


# ----------------------------------------------------------------------------- shell lines
def shell_lines(body: str) -> list[str]:
    """A bash block's lines, continuations joined, blank and comment-only lines dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            out.append(line)
    return out


def split_line(line: str) -> tuple[list[str], list[str]]:
    """(words with each ``$(depthscope data NAME)`` as ``@data:NAME``, the NAMEs)."""
    names = DATA_SUB.findall(line)
    words = shlex.split(DATA_SUB.sub(lambda m: f"@data:{m.group(1)}", line), comments=True)
    return words, names


def bash_blocks() -> list[tuple[Path, int, str]]:
    return [(p, i, body) for p in pages() for i, body in enumerate(blocks(p, "bash"))]


def depthscope_lines() -> list[tuple[str, list[str]]]:
    out = []
    for page, i, body in bash_blocks():
        for line in shell_lines(body):
            words, _ = split_line(line)
            if words and words[0] == "depthscope":
                out.append((f"{page_id(page)} bash block {i + 1}", words))
    return out


def _cli():
    import typer.main

    from depthscope.analyses.cli import app

    return app, typer.main.get_command(app)


def _norm(path: str) -> str:
    return path.rstrip("/") or path


def _is_path_param(param) -> bool:
    """Typed as a path (``Path``, ``list[Path]``), or named as an input in ``INPUT_PARAMS``."""
    return "Path" in param.bare_type() or param.name in INPUT_PARAMS


def command_values(cmd, words: list[str]) -> list[tuple[object, str]]:
    """(click parameter, value) for every option value and argument of one command line."""
    opts = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    arguments = [p for p in cmd.params if p.param_type_name == "argument"]
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w.startswith("-") and w != "-":
            name, eq, value = w.partition("=")
            p = opts.get(name)
            if p is None:
                raise AssertionError(f"unknown option {name}")
            if getattr(p, "is_flag", False) or getattr(p, "count", False):
                i += 1
                continue
            if not eq:
                i += 1
                value = words[i] if i < len(words) else ""
            out.append((p, value))
        elif arguments:
            out.append((arguments[0], w))
            if not arguments[0].multiple and arguments[0].nargs == 1:
                arguments.pop(0)
        else:
            raise AssertionError(f"unexpected argument {w!r}")
        i += 1
    return out


def test_docs_have_the_blocks_this_test_reads():
    assert {p.name for p in PYTHON_PAGES} >= {"hook-points.md", "lens.md", "probing.md", "patching.md"}
    assert len(depthscope_lines()) >= 20
    assert any(words[1] == "data" or "@data:" in " ".join(words) for _, words in depthscope_lines())


def test_depthscope_lines_name_real_commands_and_options():
    from typer.testing import CliRunner

    app, group = _cli()
    runner = CliRunner()
    helped = set()
    for where, words in depthscope_lines():
        if len(words) == 1 or words[1].startswith("-"):  # depthscope --version / --help
            assert set(words[1:]) <= {"--version", "--help"}, f"{where}: {' '.join(words)}"
            continue
        name = words[1]
        assert name in group.commands, f"{where} runs `depthscope {name}`, which does not exist"
        if name not in helped:
            r = runner.invoke(app, [name, "--help"])
            assert r.exit_code == 0, r.output
            helped.add(name)
        check_options(group, words, where)


def _command_and_args(group, words: list[str]):
    """The click command a ``depthscope ...`` line runs and its arguments (a group's sub-command:
    ``depthscope sae train ...``)."""
    cmd, args = group.commands[words[1]], words[2:]
    if hasattr(cmd, "commands"):
        cmd, args = cmd.commands[words[2]], words[3:]
    return cmd, args


def test_files_read_by_shell_lines_ship_or_are_written_first():
    from depthscope.probes import sample_data

    samples = set(sample_data()) | set(GENERATED)  # bundled, or generated for the default model's tokenizer
    _, group = _cli()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for page, i, body in bash_blocks():
        where = f"{page_id(page)} bash block {i + 1}"
        produced: set[str] = set()
        variables: set[str] = set()
        for line in shell_lines(body):
            words, names = split_line(line)
            assert set(names) <= samples, f"{where}: `depthscope data {names}`: samples are {sorted(samples)}"
            if not words:
                continue
            assignment = re.match(r"^(\w+)=", words[0])
            if assignment:
                variables.add(assignment.group(1))
                continue
            for var in VAR_USE.findall(line.split("#")[0]):
                assert var in variables, f"{where}: ${var} is not set earlier in the block: {line}"
            for k, w in enumerate(words):  # redirections write files
                if w in (">", ">>") and k + 1 < len(words):
                    produced.add(_norm(words[k + 1]))
                elif w.startswith(">") and len(w) > 1:
                    produced.add(_norm(w.lstrip(">")))
            if words[0] == "make":
                assert set(words[1:]) <= targets, f"{where}: `{line}`; Makefile targets: {sorted(targets)}"
            if words[0] != "depthscope" or len(words) < 2 or words[1].startswith("-"):
                continue
            cmd, args = _command_and_args(group, words)
            try:
                values = command_values(cmd, args)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}: {line}") from None
            outputs = []
            for param, value in values:
                if param.name in OUTPUT_PARAMS:
                    outputs.append(_norm(value))
                elif _is_path_param(param) and value and value != "default":
                    ok = (
                        (value.startswith("@data:") and value[len("@data:") :] in samples)
                        or _norm(value) in produced
                        or value.startswith("$")
                    )
                    assert ok, (
                        f"{where}: `depthscope {words[1]}` reads {value!r}, which neither ships "
                        f"($(depthscope data NAME)) nor is written by an earlier line of the block: {line}"
                    )
            produced.update(outputs)


def test_cheap_shell_lines_run():
    from typer.testing import CliRunner

    app, _ = _cli()
    runner = CliRunner()
    names = set()
    for page, _, body in bash_blocks():
        for line in shell_lines(body):
            words, found = split_line(line)
            names.update(found)
            if words[:1] == ["depthscope"] and (words[1:] in (["--version"], ["--help"], ["data"])):
                r = runner.invoke(app, words[1:])
                assert r.exit_code == 0, f"{page_id(page)}: `{line}` -> {r.exit_code}: {r.output}"
    assert names, "the docs read no bundled sample"
    for name in sorted(names):
        r = runner.invoke(app, ["data", name])
        assert r.exit_code == 0, r.output
        assert Path(r.output.strip()).is_file(), f"`depthscope data {name}` printed {r.output!r}"


# ----------------------------------------------------------------------------- the site
def test_site_builds_strict(tmp_path):
    for mod in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(mod, reason="the docs extra is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    for page in pages():
        rel = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if str(rel) == "index" else rel / "index.html")
        assert html.is_file(), f"{page_id(page)} was not built"
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    _, group = _cli()
    for name in group.commands:  # the generated reference holds every command and its options
        assert f"depthscope {name}" in cli, name
    assert "--stack-l2" in cli and "--checkpoint-dir" in cli
    api = (site / "api" / "hooks" / "index.html").read_text(encoding="utf-8")
    assert "load_model" in api and "residual_stream" in api and "Generation" in api
    assert ":class:`" not in api and ":func:`" not in api  # reStructuredText roles rewritten


@pytest.fixture(scope="module")
def gen_site():
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    spec = importlib.util.spec_from_file_location("docs_gen_site", DOCS / "gen_site.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rst_roles_become_code_spans(gen_site):
    text = "see :func:`~depthscope.analyses.lens.logit.logit_lens` and :class:`HookedModel`, ``x``"
    assert gen_site.rst_roles_to_markdown(text) == "see `logit_lens` and `HookedModel`, ``x``"


def test_architecture_page_is_in_the_nav():
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python tags; the nav is plain
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)["nav"]
    reference = next(item["Reference"] for item in nav if isinstance(item, dict) and "Reference" in item)
    assert {"Architecture": "architecture.md"} in reference


def test_cli_reference_is_generated_from_the_app(gen_site):
    text = gen_site.cli_reference()
    _, group = _cli()
    for name, cmd in group.commands.items():
        assert f"## depthscope {name}" in text
        for p in cmd.params:
            if p.param_type_name == "option":
                assert f"`{p.opts[0]}`" in text, (name, p.opts)


# ----------------------------------------------------------------------------- the benchmarks page
@pytest.fixture
def bench_main(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    # benchmarks._common pins the probe precision for the process: undone after the test
    monkeypatch.setenv("DEPTHSCOPE_PROBE_DTYPE", os.environ.get("DEPTHSCOPE_PROBE_DTYPE", "float32"))
    import benchmarks.__main__ as main

    return main


def test_benchmarks_page_block_has_the_generated_shape(bench_main):
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert text.count(bench_main.DOCS_BEGIN) == 1 and text.count(bench_main.DOCS_END) == 1
    block = text.split(bench_main.DOCS_BEGIN)[1].split(bench_main.DOCS_END)[0].strip().splitlines()
    assert block[0].startswith("Generated by `python -m benchmarks")
    assert block[2].startswith("Machine: ")
    assert block[4] == "| " + " | ".join(bench_main.HEADER) + " |"
    assert block[5] == "|" + "---|" * len(bench_main.HEADER)
    rows = [ln for ln in block[6:] if ln.startswith("| ")]
    cells = [re.split(r"(?<!\\)\|", ln)[1:-1] for ln in rows]
    assert len(rows) >= 15 and all(len(c) == len(bench_main.HEADER) for c in cells), rows


def test_benchmarks_docs_option_rewrites_only_the_block(bench_main, tmp_path):
    page = tmp_path / "benchmarks.md"
    original = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    page.write_text(original, encoding="utf-8")
    row = bench_main.Row("capture | all sites", "1.00 s", "0.50 s", 2.0, "<= 1.05", note="a note")
    info = {
        "time_utc": "2030-01-02T03:04:05Z",
        "load_avg_1_5_15": [0.5, 0.4, 0.3],
        "load_avg_at_start": [0.25, 0.2, 0.1],
        "cpu_count": 2,
        "threads": 1,
        "rounds": 5,
        "clock": "cpu",
        "torch": "2.13.0",
        "cpu": "Some CPU",
        "seconds": 12.0,
    }
    block = bench_main.docs_table([row], info, "python -m benchmarks --quick --docs benchmarks.md")
    bench_main.write_docs(page, block)
    new = page.read_text(encoding="utf-8")
    before, after = original.split(bench_main.DOCS_BEGIN)[0], original.split(bench_main.DOCS_END)[1]
    assert new.startswith(before) and new.endswith(after)
    assert "capture \\| all sites | 1.00 s | 0.50 s | 2 | <= 1.05 | NO |" in new
    assert "Some CPU; 2 cores; load average 0.25 at the start" in new and "2030-01-02" in new
    bench_main.write_docs(page, block)  # idempotent
    assert page.read_text(encoding="utf-8") == new
    with pytest.raises(SystemExit):
        bad = tmp_path / "no_markers.md"
        bad.write_text("# no markers\n", encoding="utf-8")
        bench_main.write_docs(bad, block)


# ----------------------------------------------------------------------------- python blocks
#: what each page's blocks claim, checked on their namespace afterwards
CLAIMS = {
    "circuits.md": lambda ns: (
        tuple(ns["heads"].nlargest(1, "fraction_recovered")[["point", "head"]].iloc[0]) == ("23.heads", 3)
        and ns["rho"] > 0.9
        and tuple(ns["direct"].nlargest(1, "fraction_recovered")[["point", "head"]].iloc[0]) == ("23.heads", 3)
        and tuple(ns["noised"].nsmallest(1, "fraction_recovered")[["point", "head"]].iloc[0]) == ("23.heads", 3)
        and set(ns["noised"]["direction"]) == {"noise"}
    ),
    "index.md": lambda ns: tuple(ns["rs"].resid.shape) == (61, 1, 5, 576),
    "getting-started.md": lambda ns: ns["model"].n_sites == 61 and ns["model"].labels[:2] == ["embed", "0.attn"],
    "hook-points.md": lambda ns: (
        ns["rs"].resid.shape[0] == 61
        and ns["early"].resid.shape[0] == 2
        and ns["real"].resid.shape[1] == int(ns["rs"].mask.sum())
        and ns["run"].keys() == ["5.pattern", "5.heads", "12.mlp"]
        and ns["g"].grad("15.attn_out").shape[-1] == 576
        and float((ns["a"] - ns["b"]).abs().max() / ns["a"].abs().max()) < 1e-5
    ),
    "lens.md": lambda ns: (
        len(ns["lens"]) == 61
        and ns["tuned"].site_labels == ["10.mlp", "20.mlp"]
        and set(ns["both"]["lens"]) == {"tuned"}
        and ns["back"].sites == list(range(0, 60, 2)) + [60]
    ),
    "norms.md": lambda ns: abs(float(ns["diff"]["contribution"].sum()) - float(ns["diff"]["logit"].iloc[0])) < 1e-3,
    "probing.md": lambda ns: (
        list(ns["res"].summary["task"]) == ["upos"] and tuple(ns["words"].features.shape) == (1, 4, 576)
    ),
    "patching.md": lambda ns: (
        tuple(ns["heads"].nlargest(1, "fraction_recovered")[["point", "head"]].iloc[0]) == ("23.heads", 3)
        and ns["estimate"]["fraction_recovered"].corr(ns["heads"]["fraction_recovered"], method="spearman") > 0.9
    ),
    "steering-generation.md": lambda ns: (
        [tuple(t.shape) for t in ns["out"].cache["5.pattern"]] == [(1, 9, 5, 5), (1, 9, 1, 6), (1, 9, 1, 7)]
    ),
    "sweeps.md": lambda ns: len(ns["checkpoints"]) == 3 and len(ns["again"].skipped) == 3 and not ns["again"].done,
}


def run_page(page: Path, tmp_path, monkeypatch) -> dict:
    import torch

    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads spin-wait on a busy 2-core machine; results do not depend on it
    namespace: dict = {"__name__": "__docs__"}
    try:
        for i, code in enumerate(blocks(page, "python")):
            # dont_inherit: the block runs as a user's script would, without this file's
            # ``from __future__ import annotations``
            exec(compile(code, f"docs/{page_id(page)} python block {i + 1}", "exec", dont_inherit=True), namespace)
    finally:
        torch.set_num_threads(threads)
    claim = CLAIMS.get(page_id(page))
    if claim is not None:
        assert claim(namespace), f"docs/{page_id(page)}: a result differs from what the page says"
    return namespace


@pytest.mark.parametrize("page", MODEL_PAGES, ids=page_id)
def test_python_blocks_run_as_written(page, tmp_path, monkeypatch, default_model):
    """``default_model`` only makes the session's one load happen first and marks this slow."""
    run_page(page, tmp_path, monkeypatch)


@pytest.mark.parametrize("page", PLAIN_PAGES, ids=page_id)
def test_python_blocks_without_the_model_run_as_written(page, tmp_path, monkeypatch):
    run_page(page, tmp_path, monkeypatch)

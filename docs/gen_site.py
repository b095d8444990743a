"""MkDocs hook (``hooks:`` in mkdocs.yml) and griffe extension for the documentation site.

* griffe cannot find ``depthscope.hooks`` by itself: the packages are installed from the folders
  ``common/``, ``hooks/``, ``probes/`` and ``analyses/`` (a package-dir mapping), so no ``depthscope/`` folder
  exists to read the source from. :func:`on_config` builds one in a temporary folder
  (``depthscope/hooks`` -> ``<repo>/hooks``, ...: symbolic links, or copies where links are not
  allowed) and gives it to mkdocstrings as its search path. Nothing is imported: the API pages
  are read from the source, as griffe does by default.
* :func:`on_page_markdown` writes the command-line reference into ``docs/cli.md`` (at the
  ``<!-- cli-reference -->`` marker) from the typer app itself: every command, its usage, help
  and options with types, ranges and defaults, as ``depthscope COMMAND --help`` shows them.
  (mkdocs-click cannot read typer >= 0.26's commands: they are built on typer's own copy of
  click, whose option classes are not ``click.Option``.)
* :class:`RstRoles` rewrites the docstrings' reStructuredText roles (``:func:`~a.b.c```) into
  Markdown code spans (``c``), since the API pages render docstrings as Markdown.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PACKAGES = ("common", "hooks", "probes", "analyses")

_shim: Path | None = None


def source_shim() -> Path:
    """A folder holding ``depthscope/<pkg>`` for each package folder of the repository."""
    global _shim
    if _shim is None:
        tmp = Path(tempfile.mkdtemp(prefix="depthscope-docs-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        (tmp / "depthscope").mkdir()
        for pkg in PACKAGES:
            target = tmp / "depthscope" / pkg
            try:
                target.symlink_to(ROOT / pkg, target_is_directory=True)
            except OSError:  # no symbolic links here: copy the sources
                shutil.copytree(ROOT / pkg, target, ignore=shutil.ignore_patterns("__pycache__", "data"))
        _shim = tmp
    return _shim


@event_priority(100)  # before the plugins read their configuration
def on_config(config, **kwargs):
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(source_shim())]
    return config


# ----------------------------------------------------------------------------- the CLI reference
CLI_MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown, page, **kwargs):
    if page.file.src_uri == "cli.md" and CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, cli_reference())
    return markdown


def _text(s: str) -> str:
    """Help text as Markdown text: angle brackets escaped (``<cache>`` is not an HTML tag)."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cell(s: str) -> str:
    return _text(s).replace("|", "\\|").replace("\n", " ")


def _help(text: str | None) -> str:
    """A command's help as Markdown: paragraphs joined into lines, indented paragraphs (examples,
    file lists) as text blocks."""
    out = []
    for para in re.split(r"\n\s*\n", (text or "").replace("\b", "").strip()):
        lines = para.splitlines()
        if not lines:
            continue
        if all(ln.startswith("  ") for ln in lines):
            width = min(len(ln) - len(ln.lstrip()) for ln in lines)
            out.append("```text\n" + "\n".join(ln[width:] for ln in lines) + "\n```")
        else:
            out.append(_text(" ".join(ln.strip() for ln in lines)))
    return "\n\n".join(out)


def _range(p) -> str:
    lo, hi = getattr(p, "min", None), getattr(p, "max", None)
    if lo is not None and hi is not None:
        return f"{lo:g} <= x <= {hi:g}"
    if lo is not None:
        return f"x >= {lo:g}"
    if hi is not None:
        return f"x <= {hi:g}"
    return ""


def _default(p) -> str:
    if getattr(p, "is_flag", False):
        if p.secondary_opts:  # --plots/--no-plots: the one in force
            return f"`{p.opts[0] if p.default else p.secondary_opts[0]}`"
        return ""
    if p.required:
        return "required"
    if p.default is None or p.default == [] or not getattr(p, "show_default", True):
        return ""
    return f"`{p.default}`" if str(p.default).strip() == str(p.default) else f"`{p.default!r}`"


def _options_table(cmd) -> list[str]:
    rows = ["| option | type | default | description |", "|---|---|---|---|"]
    for p in cmd.params:
        if p.param_type_name != "option" or getattr(p, "hidden", False):
            continue
        names = ", ".join(f"`{o}`" for o in p.opts)
        if p.secondary_opts:
            names += " / " + ", ".join(f"`{o}`" for o in p.secondary_opts)
        kind = "flag" if getattr(p, "is_flag", False) else p.bare_type()
        rng = _range(p)
        kind = _cell(kind + (f" ({rng})" if rng else ""))
        rows.append(f"| {names} | {kind} | {_cell(_default(p))} | {_cell(p.help or '')} |")
    rows.append("| `--help` | flag | | Show the command's help and exit. |")
    return rows


def cli_reference() -> str:
    """The command-line reference in Markdown, from the typer app (``depthscope.analyses.cli``)."""
    import typer.main

    from depthscope.analyses.cli import app

    group = typer.main.get_command(app)
    ctx_class = type(group).context_class
    root = ctx_class(group, info_name="depthscope")
    lines = [
        "## depthscope",
        "",
        _help(group.help),
        "",
        "```text",
        group.get_usage(root),
        "```",
        "",
        *_options_table(group),
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name in sorted(group.commands):
        first = (group.commands[name].help or "").strip().split("\n\n")[0]
        lines.append(f"| [`{name}`](#depthscope-{name}) | {_cell(' '.join(first.split()))} |")
    for name in sorted(group.commands):
        cmd = group.commands[name]
        ctx = ctx_class(cmd, info_name=name, parent=root)
        lines += ["", f"## depthscope {name}", "", _help(cmd.help), "", "```text", cmd.get_usage(ctx), "```", ""]
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        if arguments:
            lines += ["| argument | type | description |", "|---|---|---|"]
            for p in arguments:
                help_ = getattr(p, "help", None) or ""
                lines.append(f"| `{p.metavar or p.name.upper()}` | {_cell(p.bare_type())} | {_cell(help_)} |")
            lines.append("")
        lines += _options_table(cmd)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- griffe extension
try:
    import griffe
except ImportError:  # only the hook is loaded where griffe is absent
    griffe = None

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def rst_roles_to_markdown(text: str) -> str:
    """``:func:`~pkg.mod.name``` -> ```name```; without the tilde the whole path is kept."""

    def code(m: re.Match) -> str:
        target = m.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if m.group(1) else target
        return f"`{shown}`"

    return _ROLE.sub(code, text)


if griffe is not None:

    class RstRoles(griffe.Extension):
        """Docstrings' reStructuredText roles as Markdown code spans."""

        def on_object(self, *, obj, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = rst_roles_to_markdown(obj.docstring.value)

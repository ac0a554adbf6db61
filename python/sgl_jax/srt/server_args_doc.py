"""docs/server_args.md, generated from `ServerArgs`: one table per section of the dataclass.

    python -m sgl_jax.srt.server_args_doc          # rewrites docs/server_args.md of this checkout
    python -m sgl_jax.srt.server_args_doc OUT.md   # writes it elsewhere

Sections are the whole-line comments between the dataclass's fields (``# Model and tokenizer``, ``# HTTP``,
...); each field belongs to the last one above it. The flag, its value type and its default come from the
argparse parser that `ServerArgs.add_cli_args` builds; the description is the field's help (its
``metadata["help"]``, `server_args.flag_help`), the text ``--help`` prints before ``(default: ...)``. test/srt/test_server_args_doc.py fails when the checked-in
file differs from `render()`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

from sgl_jax.srt.server_args import ServerArgs, flag_help

DOC_PATH = Path(__file__).resolve().parents[3] / "docs" / "server_args.md"  # python/sgl_jax/srt/ -> repo root
REGENERATE = "python -m sgl_jax.srt.server_args_doc"

_SECTION_COMMENT = re.compile(r"^    # (\S.*)$")  # a whole-line comment at the class body's indentation


def field_sections() -> List[Tuple[str, List[str]]]:
    """[(section title, [field names in dataclass order])], from the comments in `ServerArgs`'s source.

    Raises:
        ValueError: a field above the first section comment.
    """
    source = textwrap.dedent(inspect.getsource(ServerArgs))
    lines = source.split("\n")
    (cls,) = ast.parse(source).body
    field_lines = {node.lineno: node.target.id for node in cls.body
                   if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    last_field_line = max(field_lines)
    sections: List[Tuple[str, List[str]]] = []
    for lineno, line in enumerate(lines[:last_field_line], start=1):
        match = _SECTION_COMMENT.match(line)
        if match:
            sections.append((match.group(1).strip(), []))
        elif lineno in field_lines:
            if not sections:
                raise ValueError(f"ServerArgs.{field_lines[lineno]} is above the first section comment")
            sections[-1][1].append(field_lines[lineno])
    return [(title, names) for title, names in sections if names]


def _parser_actions() -> Dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {action.dest: action for action in parser._actions if action.dest != "help"}


def _value_kind(action: argparse.Action) -> str:
    """What follows the flag on the command line ('' for a switch)."""
    if action.nargs == 0:  # store_true
        return ""
    kind = {int: "INT", float: "FLOAT", str: "STR"}.get(action.type, "VALUE")
    return f"{kind} [{kind} ...]" if action.nargs == "+" else kind


def _cell(text: str) -> str:
    """`text` safe inside a markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;") \
        .replace("\n", " ")


def _anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def render() -> str:
    """The whole of docs/server_args.md."""
    actions = _parser_actions()
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    helps = {f.name: flag_help(f) for f in dataclasses.fields(ServerArgs)}
    sections = field_sections()
    out = [
        "# Server arguments",
        "",
        f"<!-- Generated from ServerArgs (python/sgl_jax/srt/server_args.py) by `{REGENERATE}`; "
        "do not edit by hand. -->",
        "",
        "Every field of `ServerArgs` (python/sgl_jax/srt/server_args.py) is a flag of "
        "`python -m sgl_jax.launch_server` (the field name with `-` for `_`) and a keyword argument of "
        "`sgl_jax.Engine(...)` (the field name). `python -m sgl_jax.launch_server --help` prints the same "
        "descriptions, each followed by its default. A flag without a value is a switch (off by default). A default "
        "of `None` means unset: the description says what happens then (most such values are derived at start-up "
        "from the model, the device or the environment). `ServerArgs` checks the values when it is built, before "
        "anything loads; an error names the flag.",
        "",
        " · ".join(f"[{title}](#{_anchor(title)})" for title, _ in sections),
        "",
    ]
    for title, names in sections:
        out += [f"## {title}", "", "| flag | default | description |", "|---|---|---|"]
        for name in names:
            action = actions[name]
            flag = " ".join(filter(None, (action.option_strings[0], _value_kind(action))))
            out.append(f"| `{flag}` | `{defaults[name]}` | {_cell(helps[name])} |")
        out.append("")
    return "\n".join(out)


def main(argv: List[str]) -> None:
    path = Path(argv[0]) if argv else DOC_PATH
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])

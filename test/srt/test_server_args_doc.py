"""docs/server_args.md is generated from ServerArgs (python/sgl_jax/srt/server_args_doc.py) and kept current;
every field has a help string, and --help prints the text the doc shows."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from sgl_jax.srt.server_args import ServerArgs, flag_help
from sgl_jax.srt.server_args_doc import REGENERATE, field_sections, render

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[2] / "docs" / "server_args.md"
FIELDS = [f.name for f in dataclasses.fields(ServerArgs)]
HELP = {f.name: flag_help(f) for f in dataclasses.fields(ServerArgs)}


def test_every_field_has_a_help_string():
    missing = [name for name in FIELDS if not HELP[name].strip()]
    assert not missing, f"ServerArgs fields without a help string (server_args.flag(default, help)): {missing}"


def test_every_field_is_in_one_section_in_dataclass_order():
    sections = field_sections()
    assert [name for _, names in sections for name in names] == FIELDS
    titles = [title for title, _ in sections]
    assert titles[:2] == ["Model and tokenizer", "HTTP"] and len(set(titles)) == len(titles)


def test_cli_help_is_the_doc_text_plus_the_default():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    assert helps == {name: f"{HELP[name]} (default: {defaults[name]})" for name in FIELDS}


def test_table_rows():
    text = render()
    assert "| `--model-path STR` | `None` | HF model directory" in text
    assert "| `--page-size INT` | `None` | tokens per KV cache page (default: 128 on TPU, 16 on GPU, 1 on CPU;" in text
    assert "| `--precompile-bs-paddings INT [INT ...]` | `None` |" in text
    assert "| `--enable-metrics` | `False` |" in text
    assert "| `--dtype STR` | `auto` | float32 (float) \\| bfloat16 \\|" in text  # '|' escaped inside a cell
    for name in FIELDS:
        flag = "--" + name.replace("_", "-")
        assert len(re.findall(rf"^\| `{flag}[ `]", text, flags=re.M)) == 1, flag


def test_checked_in_doc_is_current():
    assert DOC.is_file(), f"{DOC} is missing; run `{REGENERATE}`"
    assert DOC.read_text() == render(), f"docs/server_args.md is out of date with ServerArgs; run `{REGENERATE}`"

"""Structured output: grammars (JSON schema, regex, EBNF) turned into per-step token masks (llguidance)."""

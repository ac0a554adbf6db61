"""Readers of model output: tool calls (tool_call_parser)."""

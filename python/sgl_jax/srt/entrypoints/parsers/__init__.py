"""Readers of model output: tool calls (tool_call_parser) and the thinking part of reasoning models
(reasoning_parser)."""

"""Text in and out of a model: tokenizers and chat templates, tool calls, constraints."""

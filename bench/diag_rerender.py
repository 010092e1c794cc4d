#!/usr/bin/env python3
"""Does a chat template give a model's answer back token for token on the next turn? The prefix
cache reuses a turn's answer only if it does (an agent re-sends the answer as text, and the
gateway renders and tokenizes the conversation again).

1. Plain text, a real model: SmolLM2-135M-Instruct (the default model) answers --prompts
   questions greedily; each conversation is rendered again with the answer as the assistant's
   message and a next user message, and the ids compared with the first prompt's ids followed
   by the generated ones.
2. Tool calls (OpenAI `tool_calls`; the Messages API's `tool_use` blocks become the same
   message in the gateway), Qwen's tool-calling template: the call as a model writes it
   (`<tool_call>` + JSON with its keys in the order the model wrote them) against the template's
   rendering of the parsed call. Compared as text: if the text differs the tokens do.

    python bench/diag_rerender.py [--prompts 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?", "Explain recursion briefly.",
             "What does HTTP 404 mean?", "Name three prime numbers.",
             "What is a closure in JavaScript?", "Give me a git command to undo a commit.",
             "Why is the sky blue?", "Summarize what a hash table is.",
             "What is 17 times 23?", "Translate 'good morning' into Spanish.",
             "What is a mutex?", "How do I read a file line by line in Python?",
             "What is the difference between TCP and UDP?", "Suggest a name for a cat.",
             "What does `ls -la` print?", "Define entropy in one sentence.",
             "How many bytes are in a kilobyte?", "What is a Python decorator?"]

# Calls as an agent's model writes them (keys in its own order, shell and path characters).
CALLS = [("Read", {"file_path": "/src/app/main.py"}),
         ("Bash", {"command": "cd /repo && pytest -q tests/ 2>&1 | tail -5",
                   "description": "Run the tests"}),
         ("Edit", {"file_path": "a.py", "old_string": "x < 1", "new_string": "x <= 1"}),
         ("Grep", {"pattern": "def main", "path": "src", "output_mode": "content"}),
         ("Glob", {"pattern": "**/*.ts"}),
         ("Write", {"file_path": "notes.md", "content": "It's done & tested.\n"}),
         ("TodoWrite", {"todos": [{"content": "fix parser", "status": "pending"}]}),
         ("Bash", {"command": "echo \"héllo\" > out.txt"}),
         ("Read", {"file_path": "README.md", "offset": 10, "limit": 40}),
         ("WebFetch", {"url": "https://example.com/a?b=1&c=2", "prompt": "summarize"})]


def plain_text(n: int, max_tokens: int) -> tuple[int, list[str]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from omlx_shared.model_spec import resolve_model

    model, tok = load(str(resolve_model(None)))
    same, notes = 0, []
    for q in QUESTIONS[:n]:
        msgs = [{"role": "user", "content": q}]
        p1 = tok.apply_chat_template(msgs, add_generation_prompt=True)
        out = []
        for t, _ in generate_step(mx.array(p1), model, max_tokens=max_tokens):
            if int(t) in tok.eos_token_ids:
                break
            out.append(int(t))
        answer = tok.decode(out)
        p2 = tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer},
                                             {"role": "user", "content": "Thanks."}],
                                     add_generation_prompt=True)
        if p2[:len(p1) + len(out)] == p1 + out:
            same += 1
        else:
            at = next(i for i, (a, b) in enumerate(zip(p2, p1 + out)) if a != b)
            notes.append(f"{q!r}: differs at answer token {at - len(p1)} of {len(out)}")
    return same, notes


def tool_calls() -> tuple[int, list[str]]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from tests.tiny_models import QWEN_TEMPLATE

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    template = env.from_string(QWEN_TEMPLATE)
    same, notes = 0, []
    for name, args in CALLS:
        written = ("<tool_call>\n" + json.dumps({"name": name, "arguments": args},
                                                 ensure_ascii=False) + "\n</tool_call>")
        msg = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function",
                               "function": {"name": name, "arguments": args}}]}
        text = template.render(messages=[{"role": "user", "content": "go"}, msg])
        if "<|im_start|>assistant\n" + written + "<|im_end|>" in text:
            same += 1
        else:
            notes.append(f"{name} {list(args)}: rendered "
                         f"{text.split('<|im_start|>assistant')[1][:120]!r}")
    return same, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    same, notes = plain_text(args.prompts, args.max_tokens)
    print(f"plain text (SmolLM2-135M-Instruct, its template): {same} of {args.prompts} answers "
          "re-rendered token for token")
    for n in notes:
        print("  -", n)
    same, notes = tool_calls()
    print(f"tool calls (Qwen's template): {same} of {len(CALLS)} re-rendered as written")
    for n in notes:
        print("  -", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())

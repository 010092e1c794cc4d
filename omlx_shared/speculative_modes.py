"""The speculative decoding modes a model can be served with (omlx_node/speculation.py):
"off" (no drafts, a request's prediction unused too), "ngram" (prompt lookup drafts, and a
request's prediction), "auto" (ngram where the node measures that drafts can pay), and
"draft=PATH" (a small model of the same tokenizer, in the folder PATH on the node that runs
the model, drafts; a request's prediction still drafts its own row).

"mtp" (a checkpoint's multi-token-prediction heads) is refused: mlx-lm 0.32 loads no family's
MTP layers (deepseek_v3 and glm4_moe drop `num_nextn_predict_layers`' weights when they load),
so there is nothing to draft with (docs/speculative.md)."""

from __future__ import annotations

MODES = ("off", "ngram", "auto")
DRAFT = "draft="
MTP_REFUSAL = ("speculative mode 'mtp' is not available: mlx-lm 0.32 loads no model family's "
               "multi-token-prediction heads (deepseek_v3 and glm4_moe drop their "
               "num_nextn_predict_layers weights on load); use draft=PATH (a small model of "
               "the same tokenizer) or ngram")


def check_mode(mode: str) -> str:
    """`mode` if it names a speculation mode; ValueError saying which do otherwise."""
    if mode == "mtp":
        raise ValueError(MTP_REFUSAL)
    if mode.startswith(DRAFT):
        if not mode[len(DRAFT):].strip():
            raise ValueError("speculative mode 'draft=' names no folder: use draft=PATH, the "
                             "folder of a small model with the served model's tokenizer")
        return mode
    if mode not in MODES:
        raise ValueError(f"unknown speculative mode {mode!r}: use one of {', '.join(MODES)}, "
                         f"or draft=PATH")
    return mode


def draft_path(mode: str) -> str:
    """The draft model's folder a "draft=PATH" mode names; "" for any other mode."""
    return mode[len(DRAFT):] if mode.startswith(DRAFT) else ""

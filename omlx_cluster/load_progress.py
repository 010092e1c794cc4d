"""What `models load` shows while the gateway loads: the model's stages as `/cluster/status`
tells them ("loading … (plan …)", "transferring weights: node X/Y MB"), a spinner on a
terminal and a line per change elsewhere, instead of a silent wait of many seconds."""

from __future__ import annotations

import sys
import threading

import httpx
from rich.console import Console

POLL_SECONDS = 0.5


def stages_of(status: dict, name: str) -> str:
    """The model's replicas' statuses in one text; "" when the gateway does not list it."""
    for m in status.get("models") or []:
        if m.get("id") == name or name in (m.get("aliases") or []):
            return "; ".join(r["status"] for r in m.get("replicas") or [] if r.get("status"))
    return ""


def watch_load(url: str, headers: dict[str, str], name: str, done: threading.Event,
               console: Console) -> None:
    """Until `done`: polls `url`/cluster/status and shows each new status of model `name`.
    Polling failures are silent: the load request itself reports what went wrong."""
    shown = ""
    spinner = console.status(f"loading {name}") if console.is_terminal else None
    if spinner is not None:
        spinner.start()
    try:
        with httpx.Client(timeout=5, headers=headers) as client:
            while not done.wait(POLL_SECONDS):
                try:
                    text = stages_of(client.get(url + "/cluster/status").json(), name)
                except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                    continue
                if text and text != shown:
                    shown = text
                    if spinner is not None:
                        spinner.update(f"{name}: {text}")
                    else:
                        print(f"{name}: {text}", file=sys.stderr, flush=True)
    finally:
        if spinner is not None:
            spinner.stop()

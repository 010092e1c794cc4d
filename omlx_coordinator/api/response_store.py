"""The responses kept for `previous_response_id` (the Responses API's conversation state): in
memory, at most `capacity` of them, the least recently used forgotten first. Each keeps its
whole conversation as chat-template messages (its input, the chain before it, its output), so
continuing one needs no other; lists share their messages, so a long chain costs references,
not copies. Lost on restart: a client then gets the 400 for an unknown id and sends the
conversation again (Codex sends it whole every turn, store false)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True)
class StoredResponse:
    messages: tuple[dict, ...]  # the conversation through this response, instructions aside


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def __len__(self) -> int:
        return len(self._items)

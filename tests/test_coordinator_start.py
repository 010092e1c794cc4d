"""What a coordinator does before it listens: as little as it can. Its nodes register over
HTTP, so every second of CPU before it listens is a second (many, on a loaded machine) before a
restarted coordinator finds its cluster again: the tokenizers load after, on a thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from omlx_coordinator.models.model_config import ModelConfig
from omlx_coordinator.models.served_model import ServedModel
from tests.cluster_secret import SECRET
from tests.conftest import free_port

# Runs `coordinator` to the point where it would start serving, and says what was imported.
_UNTIL_LISTENING = """
import json, sys
import uvicorn
from omlx_cluster.cli import main

def listen(self, sockets=None):
    print(json.dumps({"transformers": "transformers" in sys.modules}))
    raise SystemExit(0)

uvicorn.Server.run = listen
main(sys.argv[1:])
"""


def test_the_coordinator_listens_before_it_imports_transformers(tiny_model_path, tmp_path):
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(tmp_path / "home"), OMLX_CLUSTER_SECRET=SECRET)
    out = subprocess.run([sys.executable, "-c", _UNTIL_LISTENING, "coordinator", "--port",
                          str(free_port()), "--no-discovery", "--model",
                          f"m={tiny_model_path}"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"transformers": False}, out.stderr


def test_a_tokenizer_loads_once_on_first_use(tiny_model_path):
    served = ServedModel(ModelConfig("m", str(tiny_model_path)), tiny_model_path)
    assert served._tokenizer is None  # not at construction: the gateway loads it on a thread
    # The config's vocabulary is known without the tokenizer.
    config = json.loads((Path(tiny_model_path) / "config.json").read_text())
    assert served.vocab_size == config["vocab_size"] and served._tokenizer is None
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(served.tokenizer)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == 4 and all(t is seen[0] for t in seen)
    assert served.tokenizer.encode("Hello world") == seen[0].encode("Hello world")

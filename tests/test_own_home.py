"""Tests never touch the user's real data folder."""

import os
from pathlib import Path

from omlx_shared.model_store import data_home


def test_the_session_has_its_own_home() -> None:
    assert data_home() != Path.home() / ".omlx-cluster"
    assert os.environ["OMLX_CLUSTER_HOME"] == str(data_home())

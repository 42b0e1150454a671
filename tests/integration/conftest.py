import os
import sys

import pytest

from infra.prefect_server import start_server


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real standalone Prefect server on a free loopback port, stopped after the session."""
    state = tmp_path_factory.mktemp("prefect-state")
    from infra.prefect_server import free_port

    server = start_server(state_dir=state, port=free_port())
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url
    _refresh_prefect_settings()
    yield server.api_url
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # ship buffered logs while the server is still up
    if old is None:
        os.environ.pop("PREFECT_API_URL", None)
    else:
        os.environ["PREFECT_API_URL"] = old
    _refresh_prefect_settings()
    server.stop()


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings from the environment once, when first imported. An earlier
    test (the e2e stack's client) may have imported it before PREFECT_API_URL was set."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()

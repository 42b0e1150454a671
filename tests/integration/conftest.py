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
    old = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    os.environ.update(server.client_env())  # the server requires basic auth
    _refresh_prefect_settings()
    yield server.api_url
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # ship buffered logs while the server is still up
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _refresh_prefect_settings()
    server.stop()


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings from the environment once, when first imported. An earlier
    test (the e2e stack's client) may have imported it before PREFECT_API_URL was set."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()

import os

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
    yield server.api_url
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # ship buffered logs while the server is still up
    if old is None:
        os.environ.pop("PREFECT_API_URL", None)
    else:
        os.environ["PREFECT_API_URL"] = old
    server.stop()

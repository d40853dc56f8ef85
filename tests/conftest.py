import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests run the same examples on every machine (derandomize) so that CI is reproducible;
# set LPSIM_HYPOTHESIS=explore locally to search new ones.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("explore" if os.environ.get("LPSIM_HYPOTHESIS") == "explore" else "ci")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and a busy machine cannot stall the second one.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

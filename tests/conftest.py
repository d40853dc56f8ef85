import os

from hypothesis import HealthCheck, settings

# Property tests run the same examples on every machine (derandomize) so that CI is reproducible;
# set LPSIM_HYPOTHESIS=explore locally to search new ones.
settings.register_profile(
    "ci", deadline=None, derandomize=True, max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore", deadline=None, max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("explore" if os.environ.get("LPSIM_HYPOTHESIS") == "explore" else "ci")

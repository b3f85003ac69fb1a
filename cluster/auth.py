"""Ray token authentication when joining a cluster (no ray import here: it must run before ray loads)."""

from __future__ import annotations

import os


def token_auth_for_join(address: str | None) -> bool:
    """Clusters started with `ray start` require Ray's token authentication by default, and a driver
    joining one only presents its token in token mode. With a token at hand (RAY_AUTH_TOKEN or
    ~/.ray/auth_token) and no explicit RAY_AUTH_MODE, turn token mode on. Ray reads the mode when it
    is first imported, so this runs before that. Returns whether it turned token mode on."""
    if address is None or "RAY_AUTH_MODE" in os.environ:
        return False
    token_file = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"
        return True
    return False


def choose_auth_mode(address: str | None) -> str:
    """Decide Ray's token authentication before ray is imported, and say what was decided.

    Joining a cluster: token mode when a token is at hand (`token_auth_for_join`). The embedded instance:
    token mode, explicitly — its ports listen on 127.0.0.1 only (`cluster.launch.start_ray`), and the token
    keeps the machine's other users and processes out of them too (Ray creates ~/.ray/auth_token when there
    is none).
    An explicit RAY_AUTH_MODE always wins.
    """
    import logging

    log = logging.getLogger(__name__)
    if "RAY_AUTH_MODE" in os.environ:
        mode = os.environ["RAY_AUTH_MODE"]
        log.info("Ray token authentication: %s (RAY_AUTH_MODE)", mode)
    elif address is None:
        os.environ["RAY_AUTH_MODE"] = mode = "token"
        log.info("embedded Ray: token authentication on (its ports listen on 127.0.0.1 only; the token, "
                 "~/.ray/auth_token, keeps other local users out); set RAY_AUTH_MODE=disabled to turn it off")
    else:
        mode = "token" if token_auth_for_join(address) else "cluster default"
        log.info("joining %s: Ray token authentication %s", address, mode)
    return mode

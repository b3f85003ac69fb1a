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

"""The one exception family of kvops, and the exit codes it maps to.

Every ``kvops`` command ends at a single boundary (``kvops.ops.cli.main.main``) that turns these
into a one-line message and an exit code: 0 ok, 1 error, 2 bad usage/input, 3 a check or SLO
failed. Inside ``vllm serve`` the plugin turns a ``KvopsPluginError`` into
``kvops: refusing to start: <reason>`` and exit code 2.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_CHECK_FAILED = 3


class KvopsError(Exception):
    """Base of every error kvops reports to a user; the message says what to do next."""

    exit_code = EXIT_ERROR


class BadInputError(KvopsError):
    """Input (a flag, a file, a field) is wrong: name it and say how to fix it."""

    exit_code = EXIT_BAD_INPUT


class CheckFailedError(KvopsError):
    """A check, a plan verification or an SLO did not pass."""

    exit_code = EXIT_CHECK_FAILED


class KvopsPluginError(BadInputError):
    """A kvops setting or environment that makes the server unable to run as asked.

    Raised in the front-end process before the engine starts; the message is one line that
    names the setting and the fix.
    """

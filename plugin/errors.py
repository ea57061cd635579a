"""The plugin's one exception family."""

from __future__ import annotations


class KvopsPluginError(Exception):
    """A kvops setting or environment that makes the server unable to run as asked.

    Raised in the front-end process before the engine starts; the message is one line that
    names the setting and the fix.
    """

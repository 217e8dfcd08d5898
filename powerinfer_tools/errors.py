"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an impossible request: the message is shown to the user as is."""

"""The one exception type users see: it carries a message that names the field or file and the fix."""


class UserError(Exception):
    """A problem with the user's input (config, devices, files). The CLI prints it and exits 2."""

    exit_code = 2

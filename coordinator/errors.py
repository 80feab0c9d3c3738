class UserError(Exception):
    """Bad input from the user: printed as one line (naming the option) and exit code 2, no traceback."""

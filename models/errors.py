"""Errors about models that the user can act on (unknown name, missing file, unsupported file)."""


class ModelError(ValueError):
    """One line that says what is wrong with the model and what to do."""

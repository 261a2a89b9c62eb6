"""Errors a person can cause and fix; the CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Base for mistakes in input a person controls (config, files, keys, arguments)."""

"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class SpeclaError(Exception):
    """Base class for errors caused by user input, not by a bug in specla."""


class CheckpointError(SpeclaError):
    """A model directory is missing, incomplete or inconsistent with its config."""


class UnsupportedConfigError(CheckpointError):
    """A config asks for a feature specla does not implement."""


class InputError(SpeclaError, ValueError):
    """A prompt, token ids, a prompt suite or an option is invalid (a ValueError too)."""


class TopologyError(SpeclaError):
    """A draft topology (parent array) is malformed."""


class MissingDataError(SpeclaError, FileNotFoundError):
    """A corpus, dataset or tokenizer file a command needs is not there (the message says how to
    make it)."""

"""The one error type the user sees: raised for bad config or input, printed as one line."""


class GptlabError(Exception):
    """A problem with the user's config or inputs (not a bug): the message says what to do."""

"""The error type the user sees, and the two ways any other failure is caught."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


class GptlabError(Exception):
    """A problem with the user's config or inputs (not a bug): the message says what to do."""


class Superseded(GptlabError):
    """A search trial's job that a later launch of the trial replaced: it ends untouched."""


# The package catches `Exception` blindly in these helpers, and in the few places that name their
# reason in place (tests/system/test_design.py counts them): side work that must never stop a run,
# and a library's failure that the user must read as one line.


@contextmanager
def never_fatal(say: Callable[[BaseException], None]) -> Iterator[None]:
    """Side work whose failure must never stop the run: it is logged and the caller goes on.

    Side work is a record, a plot, a copy in a store; the failure goes to `say` (one log line).
    """
    try:
        yield
    except Exception as e:  # noqa: BLE001 - the one place side work's failure is swallowed
        say(e)


@contextmanager
def as_user_error(message: Callable[[BaseException], str]) -> Iterator[None]:
    """A library call whose failure is the user's to fix, its failure as one GptlabError line.

    Such as a store that does not answer, a name that is wrong: any failure becomes one GptlabError
    line; a GptlabError passes unchanged.
    """
    try:
        yield
    except GptlabError:
        raise
    except Exception as e:  # noqa: BLE001 - every library's own errors, as one line
        raise GptlabError(message(e)) from None


def or_none(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Optional[Any]:
    """call(*args, **kwargs), or None when it fails.

    For a record that may be missing or unreadable, where the caller has a way on without it.
    """
    try:
        return call(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the caller treats any failure as "not there"
        return None

"""Entry-point plumbing shared by the ``python -m gptlab.*`` commands: errors as one line.

Hydra prints config errors over several lines with a hint about HYDRA_FULL_ERROR; gptlab's
contract is one line naming the key, and a non-zero exit. We ask Hydra to re-raise (by setting
HYDRA_FULL_ERROR for it) and print the condensed message ourselves. A user who sets
HYDRA_FULL_ERROR=1 still gets the full traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from gptlab.errors import GptlabError

_SKIP = ("object_type=", "reference_type=", "Set the environment variable HYDRA_FULL_ERROR")


def condense(message: str) -> str:
    """Fold a multi-line Hydra / OmegaConf message into one readable line."""
    parts, options = [], []
    in_options = False
    for raw in str(message).splitlines():
        line = raw.strip()
        if not line or line.startswith(_SKIP):
            continue
        if line.startswith("Available options"):
            in_options = True
            continue
        if in_options and raw.startswith(("\t", "  ")):
            options.append(line)
            continue
        in_options = False
        parts.append(line.rstrip(".") if not line.startswith("full_key:") else f"({line})")
    text = ": ".join(p for p in parts if not p.startswith("(")) + "".join(f" {p}" for p in parts if p.startswith("("))
    if options:
        text += f" (available: {', '.join(options)})"
    return text


def fail(prog: str, error: Exception) -> None:
    """Print a user error as one line and exit 2 (SystemExit passes Hydra's job logging silently)."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(2)


def run_entry(main: Callable[[], Any], prog: str) -> None:
    """Call a Hydra main function; user errors become `prog: error: <one line>` and exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except GptlabError as e:
        if user_wants_traceback:
            raise
        fail(prog, e)
    except (HydraException, OmegaConfBaseException) as e:
        if user_wants_traceback:
            raise
        print(f"{prog}: error: {condense(str(e))}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)

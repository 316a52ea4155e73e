"""``--params all|head|backbone|REGEX``: which weights a training comparison looks at.

The head is defined by name, never by the order modules were registered in: a parameter belongs to the head
when its top-level module, past wrapper prefixes (:data:`WRAPPERS`), has one of the names in
:data:`HEAD_MODULES` (``classifier.weight``, ``module.model.lm_head.weight``). The backbone is every other
parameter. A model whose head is called otherwise is selected with a regex (``--params '^my_head\\.'``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from parity_harness.common.errors import InputError
from parity_harness.replay.naming.bounded import time_limited

__all__ = ["HEAD_MODULES", "WRAPPERS", "ParameterFilter", "is_head", "parameter_filter"]

HEAD_MODULES: Final = frozenset(
    {
        "head",
        "heads",
        "classifier",
        "classification_head",
        "fc",
        "lm_head",
        "decoder",
        "ctc_decoder",
        "output",
        "output_layer",
        "out",
        "cls",
        "final_layer",
        "proj_out",
        "logits",
    }
)
"""Top-level module names read as a model's head (``decoder``: NeMo's CTC models call their head so)."""
WRAPPERS: Final = ("module", "model", "_orig_mod", "net")
"""Leading name parts that wrap a whole model (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``)."""


def is_head(name: str) -> bool:
    """Whether parameter ``name`` lies in the head (its top-level module past wrappers is in HEAD_MODULES)."""
    parts = name.split(".")[:-1]  # the parameter's own name is not a module
    while len(parts) > 1 and parts[0] in WRAPPERS:
        parts = parts[1:]
    return bool(parts) and parts[0] in HEAD_MODULES


@dataclass(frozen=True)
class ParameterFilter:
    """A ``--params`` choice; ``search(name)`` tells whether a parameter (in run A's naming) is compared."""

    spec: str
    pattern: re.Pattern[str] | None = None

    def search(self, name: str) -> bool:
        """Whether ``name`` is selected."""
        if self.spec == "all":
            return True
        if self.spec in ("head", "backbone"):
            return is_head(name) == (self.spec == "head")
        assert self.pattern is not None
        with time_limited(name) as attempt:  # --params is the user's pattern
            attempt.pattern = self.pattern
            return self.pattern.search(name) is not None

    def matched_nothing(self, names: list[str]) -> bool:
        """A filter other than ``all`` that selects none of ``names`` (and there are some)."""
        return self.spec != "all" and bool(names) and not any(self.search(n) for n in names)

    def nothing_message(self, path: Path) -> str:
        """The error for a filter that selects nothing (a typo would otherwise compare no weight and pass)."""
        if self.spec in ("head", "backbone"):
            detail = f"no top-level module (past {', '.join(WRAPPERS)}) is named {', '.join(sorted(HEAD_MODULES))}"
            return f"--params {self.spec} selects no parameter of {path}: {detail}; pass a regex instead"
        return f"--params {self.spec!r} matches no parameter name of {path}; pass all, or a regex matching its names"


def parameter_filter(params: str | None) -> ParameterFilter:
    """Parse ``--params`` (``all`` when None or empty).

    Raises:
        InputError: neither all, head, backbone nor a valid regex.
    """
    if params in (None, "", "all"):
        return ParameterFilter("all")
    assert params is not None
    if params in ("head", "backbone"):
        return ParameterFilter(params)
    try:
        return ParameterFilter(params, re.compile(params))
    except re.error as err:
        raise InputError(f"--params {params!r}: not all, head, backbone or a valid regex ({err})") from err

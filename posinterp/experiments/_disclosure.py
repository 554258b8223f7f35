"""The "Choices made after seeing results" section of a reproduction page (issue 37 item 3).

A reader can weigh a verdict only knowing which of its settings were chosen after some
results were in: a task switched because the first did not train, a measurement point
named primary after the candidates were compared, seeds added after a first grid. Each
experiment module lists its own :class:`Choice` s (what, when, which commit, what had been
seen); this module renders them, the same way on every page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Choice", "disclosure_section"]


@dataclass(frozen=True)
class Choice:
    """One setting chosen (or changed) after results were seen.

    ``what``: the choice as the page now has it; ``seen``: what had been seen when it was
    made; ``commit``/``date``: where it entered the code (git short hash, ISO date);
    ``applies``: whether a run's recorded config (run.json's ``config``) has the choice
    (None: every run), so a page rendered from an earlier run lists only its own choices.
    """

    what: str
    seen: str
    commit: str
    date: str
    applies: Callable[[dict], bool] | None = None


def disclosure_section(choices: tuple[Choice, ...], fixed_before: str = "",
                       config: dict | None = None) -> list[str]:
    """Markdown lines of the section: every choice (that ``config``, the run's recorded
    config, has: :attr:`Choice.applies`) with its commit and date, then ``fixed_before``
    (what was fixed before any result, if the page says so)."""
    choices = tuple(c for c in choices
                    if c.applies is None or config is None or c.applies(config))
    lines = ["## Choices made after seeing results\n",
             "Each of these was chosen or changed after some results of this experiment had "
             "been seen; a verdict that rests on one is weaker than a pre-registered one by "
             "an amount this page cannot measure.\n"]
    lines += [f"- **{c.what}** ({c.date}, commit `{c.commit}`). Seen before: {c.seen}"
              for c in choices]
    lines.append("")
    if fixed_before:
        lines.append(fixed_before + "\n")
    return lines

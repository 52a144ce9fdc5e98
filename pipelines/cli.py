"""What the pipelines' command lines share."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except an unset one's (None): the help of such an option says
    what leaving it out means, and "(default: None)" after that would only contradict it."""

    def _get_help_string(self, action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)

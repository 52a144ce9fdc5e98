"""Tool calls in a model's own syntax: each format (sala/tools/format.py) owns its call's grammar,
the structural tag of a request's tool_choice, and the parser from the output's text back to
content and calls. `FORMATS` by name, as --tool-call-parser names them; `TEMPLATE_MARKS` tell
the one a checkpoint's chat template writes (sala/text_markers.py's `detected`)."""
from sala.tools.format import Call, Function, Parsed, ToolCallFormat, special_texts
from sala.tools.hermes import Hermes
from sala.tools.minicpm import MiniCPM
from sala.tools.minicpm5 import MiniCPM5

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), MiniCPM(), MiniCPM5())}
# What a chat template that renders tool calls writes for them, most specific first: a template
# holding one of these writes that format's calls.
TEMPLATE_MARKS = (('<function name="', "minicpm5"), ("<tool_call>", "hermes"), ("<|tool_call|>", "minicpm"))

__all__ = ["Call", "FORMATS", "Function", "Hermes", "MiniCPM", "MiniCPM5", "Parsed", "TEMPLATE_MARKS", "ToolCallFormat",
           "special_texts"]

"""Tool calling in chat completions: OpenAI's ``tools`` / ``tool_choice`` for models whose chat template
renders tools.

The tool definitions go to the template (its own way of describing them). The model answers a call the way
Hermes-style templates (Qwen 2.5, SmolLM3, Hermes) teach it: ``<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>``. The output is constrained with a grammar in which each call's arguments follow that tool's
JSON schema: ``tool_choice="required"`` or a named tool makes a call mandatory; ``"auto"`` lets the model
answer in text instead (text that does not start with ``<``). :func:`split_tool_calls` turns the text back
into OpenAI's ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from kvcore.errors import InvalidRequestError
from kvcore.interfaces.structured import StructuredOutput
from kvcore.sampling.structured import JSON_OPTIONS
from kvcore.text.tokenizer import Tokenizer

__all__ = ["ToolRequest", "parse_tools", "split_tool_calls", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def _bad(name: str, what: str, value: object) -> InvalidRequestError:
    exc = InvalidRequestError(f"'{name}' must be {what}, got {value!r}")
    exc.param = name  # type: ignore[attr-defined]
    return exc


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat request: ``tools`` as the template gets them, which must be called
    (``required``: any one; ``names``: those allowed), and whether several calls may follow each other."""

    tools: tuple[dict, ...]
    names: tuple[str, ...]
    required: bool
    parallel: bool

    def constraint(self) -> StructuredOutput:
        """A Lark grammar (llguidance's, with ``%json`` schemas) for a tool call, or with ``required``
        false, a call or a text answer."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": schemas[name]},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name in self.names
        ]
        body = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = {**body, "x-guidance": JSON_OPTIONS}  # compact JSON, as response_format writes it
        calls_rule = 'call ("\\n" call)*' if self.parallel else "call"
        lines = [
            f"start: {calls_rule}" if self.required else f"start: {calls_rule} | TEXT",
            "TEXT: /[^<][\\s\\S]*/",
            f"call: {json.dumps(CALL_OPEN)} args {json.dumps(CALL_CLOSE)}",
            f"args: %json {json.dumps(body)}",
        ]
        return StructuredOutput(grammar="\n".join(lines))


def parse_tools(body: Mapping, tokenizer: Tokenizer) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body; None when no tool may be called."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "'none' when no tools are given", choice)
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "a list of {'type': 'function', 'function': {...}} objects", tools)
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", tool)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise _bad(f"tools[{i}].function.parameters", "a JSON schema object", params)
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise _bad("tools", "tools with distinct names", names)
    if not tokenizer.supports_tools:
        exc = InvalidRequestError("'tools' is not supported by this model: its chat template does not render tools")
        exc.param = "tools"  # type: ignore[attr-defined]
        raise exc
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "true or false", parallel)
    if choice in (None, "auto"):
        required, allowed = False, names
    elif choice == "none":
        return None
    elif choice == "required":
        required, allowed = True, names
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping) and \
            choice["function"].get("name") in names:
        required, allowed = True, [choice["function"]["name"]]
    else:
        raise _bad("tool_choice", f"'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': "
                                  f"one of {names}}}}}", choice)
    return ToolRequest(tuple(dict(t) for t in tools), tuple(allowed), required, parallel)


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a generated answer: the ``<tool_call>`` blocks as OpenAI tool calls
    (``arguments`` as a JSON string), the text outside them as the content (None when there is none)."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue  # a call cut short by max_tokens: left in the content
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls

"""Chat messages as harnesses send them, and tool calls parsed back out of the model's text.

In: OpenAI chat messages (``content`` a string, a list of text parts or null; assistant
``tool_calls``; ``tool`` messages with ``tool_call_id``) and function ``tools``. Out: the dicts
a model's own chat template renders (``to_template``: text parts joined with newlines as vLLM
does, ``developer`` as ``system``, tool-call arguments as objects), and ``tool_calls`` parsed from
generated text by the parser named in config (``TOOL_PARSERS``, like vLLM's
``--tool-call-parser``). A part or role the model cannot take is a 400 naming it, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_CHARS = 131_072  # text prompts: bounds the tokenizer's work per call
MAX_TOOLS = 128


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(
        ..., description="only text parts: images, audio and files are refused"
    )
    text: str = Field(..., max_length=MAX_PROMPT_CHARS)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=256)
    arguments: str = Field("{}", max_length=MAX_PROMPT_CHARS)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None)
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)
    refusal: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @field_validator("content")
    @classmethod
    def _bounded(cls, content):
        if isinstance(content, str) and len(content) > MAX_PROMPT_CHARS:
            raise ValueError(f"at most {MAX_PROMPT_CHARS} characters")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def to_template(self) -> dict:
        """The message as chat templates read it."""
        out: dict = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


def _arguments(raw: str):
    """Arguments as an object for the template (templates apply ``tojson`` to them)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks; a block that is not such JSON stays in the content."""
    calls, kept, pos = [], [], 0
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args
                    if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[dict]]]] = {"hermes": hermes}


def tool_parser(name: str) -> Callable[[str], tuple[str | None, list[dict]]]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is not one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]

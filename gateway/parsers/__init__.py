"""Parsers of a model's raw reply into OpenAI chat fields: tool calls (`tool_calls.py`, one
module per format) and reasoning (`reasoning.py`); gpt-oss's Harmony messages feed both
(`harmony.py`). Pure and synchronous: text in, fields out; no service, no I/O, no tokenizer
(markers are read as text, so replies must be decoded with the markers kept).
"""

from gateway.parsers.reasoning import (
    REASONING_PARSERS,
    GptOssReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
    ThinkReasoningParser,
    reasoning_parser,
)
from gateway.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ExtractedToolCalls",
    "GptOssReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "StreamDelta",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "reasoning_parser",
    "tool_call_parser",
]
